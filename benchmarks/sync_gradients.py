"""sync_gradients() against the hand-written per-parameter all_reduce loop, and against DDP's own reducer.

Two measurements, interleaved in one process per rank:

- the synchronization alone, on gradients of the same model: `sync_gradients` against the hand-written
  per-parameter loop (``for p in params: if p.grad is not None: all_reduce(p.grad); p.grad /= world``; gloo has
  no ReduceOp.AVG);
- a whole training step: forward and backward through the inner module, then `sync_gradients`, against forward
  and backward through DDP (whose reducer all-reduces buckets during the backward pass).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import interleave, mlp, parser, ratio, timed, write
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import sync_gradients


def main() -> None:
    args = parser(rounds=80).parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))

    manual = mlp(args.depth, args.width)
    ddp = DDP(mlp(args.depth, args.width))
    params = list(manual.parameters())

    def backward(module: torch.nn.Module) -> None:
        for p in params:
            p.grad = None
        F.mse_loss(module(x), x).backward()

    def loop() -> None:
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)

    sync_times: dict[str, list[float]] = {"sync_gradients": [], "loop": []}

    def sync_only(kind: str) -> None:
        backward(manual)
        sync_times[kind].append(timed((lambda: sync_gradients(manual)) if kind == "sync_gradients" else loop))

    def manual_step() -> None:
        backward(manual)
        sync_gradients(manual)

    def ddp_step() -> None:
        ddp.zero_grad()
        F.mse_loss(ddp(x), x).backward()

    variants = {
        "sync only": lambda: sync_only("sync_gradients"),
        "loop only": lambda: sync_only("loop"),
        "manual step": manual_step,
        "ddp step": ddp_step,
    }
    for fn in variants.values():
        fn()
    for times in sync_times.values():
        times.clear()
    steps = interleave(variants, args.rounds)
    result = {
        "param_tensors": len(params),
        "rounds": args.rounds,
        "sync_ms": round(sorted(sync_times["sync_gradients"])[args.rounds // 2] * 1e3, 3),
        "loop_ms": round(sorted(sync_times["loop"])[args.rounds // 2] * 1e3, 3),
        "ddp_step_ms": round(sorted(steps["ddp step"])[args.rounds // 2] * 1e3, 3),
        "sync_gradients": ratio(
            sync_times["sync_gradients"],
            sync_times["loop"],
            vs="per-parameter all_reduce loop",
            goal="<= 0.2x (5x faster)",
        ),
        "step with sync_gradients": ratio(
            steps["manual step"], steps["ddp step"], vs="DDP step (native reducer)", goal="<= 1.25x"
        ),
    }
    write(result, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
