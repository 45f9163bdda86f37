"""An Accelerate training loop whose model has a module the loss never uses, observed with
ddp_doctor.integrations.accelerate.observe. Meant for `accelerate launch`; runs the same under torchrun or
`ddp-doctor check`, since Accelerator() reads the launcher's environment variables.

Usage: torchrun --nproc-per-node 2 accelerate_unused.py OUTPUT_DIR [--apply REPORT_JSON]
  (no --apply)  find_unused_parameters=True, the usual answer to DDP's crash with the unused module
  --apply FILE  the flags of a previous report, through kwargs_handler(report), and its freeze list
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch import nn

from ddp_doctor.integrations.accelerate import kwargs_handler, observe
from ddp_doctor.report import Report


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)
        self.aux = nn.Linear(16, 1)  # an auxiliary head this loop never trains

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def train(model: nn.Module, accelerator: Accelerator) -> Report:
    """The user's loop, observed for its first 4 optimizer steps."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with observe(model, optimizer, steps=4) as doctor:
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step == 5:
                break
    return doctor.report()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--apply", metavar="REPORT_JSON")
    opts = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    if opts.apply:
        previous = json.loads(Path(opts.apply).read_text())
        handler = kwargs_handler(previous)
        for name in previous["recommendation"]["freeze_before_wrap"]:
            model.get_parameter(name).requires_grad_(False)
    else:
        handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    report = train(model, accelerator)
    if accelerator.is_main_process:
        out = Path(opts.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ddp_doctor.json").write_text(report.to_json())
        print(report)
    # Free the DDP model (prepare() keeps a reference in the Accelerator) before end_training() destroys the process
    # group: gloo (torch 2.13, CPU) otherwise aborts at interpreter exit now and then.
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()

if __name__ == "__main__":
    main()
