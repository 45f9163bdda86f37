"""A tiny model trained by Accelerate with its FSDP2 plugin (`FullyShardedDataParallelPlugin(fsdp_version=2)`).
Accelerate uses FSDP only on GPUs (on CPU it ignores the plugin), so this runs on a GPU machine (the GPU-only tests).

--mistake none          gradient accumulation with `accelerator.accumulate(model)` (sync back on for the last
                        micro-batch), the state dict gathered with accelerator.get_state_dict on every process
--mistake step-in-sync  each optimizer step is taken inside `with accelerator.no_sync(model):`, so FSDP2's
                        gradient sync is off whenever the optimizer steps
--observe FILE          the loop runs inside ddp_doctor.integrations.accelerate.observe(model, opt); the main
                        process writes the report's JSON to FILE
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class Net(nn.Module):
    _no_split_modules = ["Block"]  # Accelerate's transformer-based auto-wrap shards each Block

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.ModuleList([Block(64) for _ in range(2)])
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", default="none")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--observe", default="")
    args = parser.parse_args()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    g = torch.Generator(device=accelerator.device).manual_seed(accelerator.process_index)
    doctor = None
    if args.observe:
        from ddp_doctor.integrations.accelerate import observe

        doctor = observe(model, opt)
    with doctor if doctor is not None else contextlib.nullcontext():
        for _step in range(args.steps):
            for _micro in range(2):
                x = torch.randn(8, 16, generator=g, device=accelerator.device)
                y = torch.randint(0, 4, (8,), generator=g, device=accelerator.device)
                if args.mistake == "step-in-sync":
                    with accelerator.no_sync(model):
                        accelerator.backward(F.cross_entropy(model(x), y))
                        if _micro == 1:
                            opt.step()
                            opt.zero_grad()
                else:
                    with accelerator.accumulate(model):
                        accelerator.backward(F.cross_entropy(model(x), y))
                        opt.step()
                        opt.zero_grad()
    if doctor is not None:
        report = doctor.report()
        if accelerator.is_main_process:
            with open(args.observe, "w") as f:
                json.dump(report.to_dict(), f)
    state = accelerator.get_state_dict(model)  # every process takes part; the main one gets the full tensors
    if accelerator.is_main_process:
        moved = max((state[n].float().cpu() - b).abs().max().item() for n, b in before.items())
        print(f"{type(model).__name__}: {len(state)} tensors in the full state dict, largest change {moved:.3g}")
    accelerator.end_training()
