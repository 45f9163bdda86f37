"""Cost of the per-parameter fingerprints that guard() and refreeze() compare across ranks.

`fingerprints_batched` (what guard and refreeze use) and the per-tensor `fingerprints` (what observe uses), each
against a plain memory pass over the same parameters (one `sum()` per tensor and one host copy, as the fingerprint
does), interleaved. Also relates one fingerprint of the whole model to one DDP training step: guard(every=N) pays
it once every N steps.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import interleave, mlp, parser, ratio, write
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor.core.fingerprint import fingerprints, fingerprints_batched


def main() -> None:
    args = parser(rounds=200).parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ddp = DDP(mlp(args.depth, args.width))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    params = list(ddp.parameters())
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))

    def plain_pass() -> torch.Tensor:
        return torch.stack([p.detach().sum() for p in params]).cpu()

    def step() -> None:
        F.mse_loss(ddp(x), x).backward()
        opt.step()
        opt.zero_grad()

    variants = {
        "plain pass": plain_pass,
        "batched": lambda: fingerprints_batched(params),
        "per tensor": lambda: fingerprints(params),
        "ddp step": step,
    }
    for fn in variants.values():
        fn()
    times = interleave(variants, args.rounds)
    result = {
        "param_tensors": len(params),
        "param_elements": sum(p.numel() for p in params),
        "rounds": args.rounds,
        "batched_ms": round(sorted(times["batched"])[args.rounds // 2] * 1e3, 3),
        "per_tensor_ms": round(sorted(times["per tensor"])[args.rounds // 2] * 1e3, 3),
        "plain_pass_ms": round(sorted(times["plain pass"])[args.rounds // 2] * 1e3, 3),
        "step_ms": round(sorted(times["ddp step"])[args.rounds // 2] * 1e3, 3),
        "fingerprints_batched": ratio(
            times["batched"], times["plain pass"], vs="plain memory pass (sum per tensor)", goal="report"
        ),
        "fingerprints (per tensor)": ratio(
            times["per tensor"], times["plain pass"], vs="plain memory pass (sum per tensor)", goal="report"
        ),
        "fingerprints_batched per step": ratio(
            times["batched"], times["ddp step"], vs="one DDP step", goal="paid 1/every"
        ),
    }
    write(result, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
