"""Bytes all-reduced per step after refreeze() against before, counted through a DDP comm hook.

Two identical DDP models train side by side; after warm-up steps, the second is rebuilt with refreeze() with the
first third of its blocks frozen. Every bucket either model all-reduces passes through a comm hook that records its
size. Reports the per-step byte ratio (goal: exactly the trainable share that is left) and, interleaved, the step
time ratio.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import interleave, mlp, parser, ratio, write
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import refreeze


def counting_hook(state, bucket):  # no annotations: DDP checks the annotation objects, which strings are not
    buf = bucket.buffer()
    state.append(buf.numel() * buf.element_size())
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def main() -> None:
    args = parser(rounds=150).parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))
    sent: dict[str, list[int]] = {"before": [], "after": []}
    models = {}
    for name, log in sent.items():
        ddp = DDP(mlp(args.depth, args.width))
        ddp.register_comm_hook(log, counting_hook)
        models[name] = [ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4)]

    per_step: dict[str, list[int]] = {"before": [], "after": []}

    def step(name: str) -> None:
        ddp, opt = models[name]
        sent[name].clear()
        F.mse_loss(ddp(x), x).backward()
        opt.step()
        opt.zero_grad()
        per_step[name].append(sum(sent[name]))

    for name in models:
        step(name)
    frozen = [str(3 * i) for i in range(args.depth // 3)]  # the Linear of the first third of the blocks
    frozen += [str(3 * i + 1) for i in range(args.depth // 3)]  # and its LayerNorm
    module = models["after"][0].module
    trainable_before = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    models["after"][0] = refreeze(models["after"][0], models["after"][1], freeze=frozen)
    trainable_after = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    for name in models:
        per_step[name].clear()
        step(name)
    times = interleave({name: (lambda n=name: step(n)) for name in models}, args.rounds)
    byte_ratios = [a / b for a, b in zip(per_step["after"], per_step["before"])]
    result = {
        "param_tensors": sum(1 for _ in module.parameters()),
        "frozen_tensors": sum(1 for p in module.parameters() if not p.requires_grad),
        "rounds": args.rounds,
        "bytes_before": per_step["before"][-1],
        "bytes_after": per_step["after"][-1],
        "expected_ratio": round(trainable_after / trainable_before, 6),
        "bytes after refreeze": {
            "median_ratio": round(sorted(byte_ratios)[len(byte_ratios) // 2], 6),
            "iqr": [round(min(byte_ratios), 6), round(max(byte_ratios), 6)],
            "vs": "bytes per step before (min-max)",
            "goal": f"= {trainable_after / trainable_before:.4f} (trainable share)",
        },
        "step after refreeze": ratio(times["after"], times["before"], vs="step before refreeze", goal="report"),
    }
    write(result, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
