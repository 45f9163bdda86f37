"""wrapstate: the flags and the trainable set DDP was built with, read back from a real DDP instance."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from scenarios import Net
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import NotDDPModelError, ProcessGroupNotInitializedError
from ddp_doctor.observation.wrapstate import (
    WRAP_STATE_ATTR,
    ddp_config_of,
    model_info,
    require_ddp,
    require_process_group,
    user_name,
)

NAMES = [
    "trunk.weight",
    "trunk.bias",
    "block.0.weight",
    "block.0.bias",
    "head_a.weight",
    "head_a.bias",
    "head_b.weight",
    "head_b.bias",
]


def _info(rank: int, world: int, case: str) -> dict:
    torch.manual_seed(0)
    net = Net()
    if case in ("ambiguous", "unfrozen"):
        net.head_a.bias.requires_grad_(False)  # frozen before wrapping: DDP reduces 7 tensors
    ddp = DDP(net)
    if case == "stamped":
        setattr(
            ddp,
            WRAP_STATE_ATTR,
            {"trainable": [n != "trunk.bias" for n in NAMES], "site": "train.py:12", "framework": "transformers"},
        )
    if case in ("inferred", "ambiguous"):
        net.head_b.bias.requires_grad_(False)  # frozen after wrapping
    if case == "unfrozen":
        net.head_a.bias.requires_grad_(True)
    info = model_info(ddp, list(net.named_parameters()), [b for _, b in net.named_buffers()])
    assert info.param_names == NAMES
    return {
        "frozen_at_wrap": [n for n, t in zip(info.param_names, info.trainable_at_wrap) if not t],
        "exact": info.wrap_state_exact,
        "count": info.wrap_trainable_count,
        "site": info.ddp_site,
        "framework": info.framework,
    }


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # Launched by the doctor: the stamped state is the truth, whatever requires_grad says now.
        (
            "stamped",
            {"frozen_at_wrap": ["trunk.bias"], "exact": True, "site": "train.py:12", "framework": "transformers"},
        ),
        # No stamp, nothing changed.
        ("plain", {"frozen_at_wrap": [], "exact": True, "site": None, "framework": "torch"}),
        # No stamp; DDP's recorded tensor count and bytes identify the one parameter frozen after wrapping.
        ("inferred", {"frozen_at_wrap": [], "exact": True, "site": None, "framework": "torch"}),
        # Two frozen now, one of them since before wrapping: which one changed is unknowable.
        (
            "ambiguous",
            {"frozen_at_wrap": ["head_a.bias", "head_b.bias"], "exact": False, "site": None, "framework": "torch"},
        ),
        # More trainable now than DDP reduces: not inferred, and not exact.
        ("unfrozen", {"frozen_at_wrap": [], "exact": False, "site": None, "framework": "torch"}),
    ],
)
def test_trainable_set_at_wrap_time(tmp_path, case, expected) -> None:
    [res] = run_ranks(_info, tmp_path, world_size=1, args=(case,))
    count = res.pop("count")
    assert res == expected
    assert count == (7 if case in ("ambiguous", "unfrozen") else 8)


def _config(rank: int, world: int) -> dict:
    ddp = DDP(Net(), find_unused_parameters=True, broadcast_buffers=False, bucket_cap_mb=1)
    return ddp_config_of(ddp)


def test_flags_are_read_back_from_the_instance(tmp_path) -> None:
    assert run_ranks(_config, tmp_path, world_size=1) == [
        {
            "find_unused_parameters": True,
            "static_graph": False,
            "gradient_as_bucket_view": False,
            "broadcast_buffers": False,
            "bucket_cap_mb": 1.0,
            "device_ids": None,
        }
    ]


def test_require_ddp_names_the_type_and_the_fix() -> None:
    with pytest.raises(NotDDPModelError, match=r"thing\(\) needs .* got torch.nn.modules.linear.Linear. Wrap it"):
        require_ddp(nn.Linear(2, 2), "thing()")
    with pytest.raises(NotDDPModelError) as info:
        require_ddp("model", "thing()")
    assert str(info.value).endswith("got builtins.str.")  # no wrap hint for something that is no module


def test_require_process_group_without_one() -> None:
    with pytest.raises(ProcessGroupNotInitializedError, match=r"thing\(\) needs an initialized process group"):
        require_process_group("thing()")


def test_user_name_drops_torch_compile_prefixes() -> None:
    assert user_name("_orig_mod.encoder._orig_mod.layer.weight") == "encoder.layer.weight"
    assert user_name("head.weight") == "head.weight"
