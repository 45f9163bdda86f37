"""A `find_unused_parameters=True` model that uses every parameter, trained for 3 steps (fewer than `check`'s
default), then ended the way Accelerate's `end_training()` ends a run: `dist.destroy_process_group(None)`. The check
must report on the 3 steps it saw, as it does for `destroy_process_group()`."""

from __future__ import annotations

import torch.distributed as dist
from _train import model, train
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model(), find_unused_parameters=True)
    train(ddp, steps=3)
    dist.destroy_process_group(None)
