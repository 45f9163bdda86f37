"""What a map-style dataset holds, as a digest the ranks can compare (local facts only). The same digest on every
rank means one dataset, so a sampler that is not a DistributedSampler hands every rank the whole of it
(`shards-overlap`). Known for a `TensorDataset` (its tensors' bytes, up to `MAX_BYTES`), a `Subset` of a known
dataset, a dataset that carries a content fingerprint (a Hugging Face dataset's _fingerprint attribute) and one
that reads the files under a `root` (torchvision's); None otherwise: not known, never guessed."""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch
import torch.utils.data as tud

__all__ = ["MAX_BYTES", "dataset_digest"]

MAX_BYTES = 256 * 2**20
"""The most tensor bytes a `TensorDataset`'s digest reads (once per dataset)."""
_cache: dict[int, tuple[Any, str | None]] = {}
"""id(dataset) -> (the dataset, its digest): each dataset is read once."""


def dataset_digest(dataset: Any) -> str | None:
    """The dataset's digest (a short text), or None when what it holds cannot be told cheaply."""
    hit = _cache.get(id(dataset))
    if hit is not None and hit[0] is dataset:
        return hit[1]
    try:
        digest = _digest(dataset, [0])
    except Exception:  # noqa: BLE001  (a dataset the doctor cannot read is not known, never a crash)
        digest = None
    if len(_cache) < 64:
        _cache[id(dataset)] = (dataset, digest)
    return digest


def _digest(dataset: Any, read: list[int]) -> str | None:
    if isinstance(dataset, tud.Subset):
        inner = _digest(dataset.dataset, read)
        indices = zlib.crc32(repr(list(dataset.indices)).encode())
        return None if inner is None else f"subset {indices} of {inner}"
    if isinstance(dataset, tud.TensorDataset):
        parts = []
        for t in dataset.tensors:
            read[0] += t.numel() * t.element_size()
            if t.device.type != "cpu" or read[0] > MAX_BYTES:
                return None
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            parts.append(f"{tuple(t.shape)} {t.dtype} {zlib.crc32(data)}")
        return "tensors " + "; ".join(parts)
    fingerprint = getattr(dataset, "_fingerprint", None)
    if isinstance(fingerprint, str):
        return f"fingerprint {fingerprint}"
    root = getattr(dataset, "root", None)
    if isinstance(root, (str, os.PathLike)):
        split = (getattr(dataset, "train", None), getattr(dataset, "split", None))
        return f"{type(dataset).__qualname__} under {os.path.abspath(root)} {split} {len(dataset)}"
    return None
