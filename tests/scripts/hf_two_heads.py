"""HF Trainer on a custom PreTrainedModel with two heads, of which only one is trained (a head that never reaches the loss), with DoctorCallback.

Usage: torchrun --nproc-per-node 2 hf_two_heads.py OUTPUT_DIR [--fix freeze|static|none-unused]
  (no --fix)         the Trainer's defaults: find_unused_parameters=True copes with the unused head, at a cost
  --fix freeze       the recommendation: freeze the unused head before train(), ddp_find_unused_parameters=False
  --fix static       the other route: ddp_find_unused_parameters=False, ddp_static_graph=True
  --fix none-unused  the reduction error: ddp_find_unused_parameters=False with the head left trainable
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments
from transformers.modeling_outputs import SequenceClassifierOutput

from ddp_doctor.integrations.transformers import DoctorCallback


class TwoHeadConfig(PretrainedConfig):
    model_type = "ddp-doctor-two-heads"

    def __init__(self, vocab_size: int = 100, hidden_size: int = 16, num_labels: int = 2, **kwargs) -> None:
        super().__init__(num_labels=num_labels, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size


class TwoHeadModel(PreTrainedModel):
    """A classifier with a second (regression) head that this fine-tuning never uses."""

    config_class = TwoHeadConfig

    def __init__(self, config: TwoHeadConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = nn.Linear(config.hidden_size, config.hidden_size)
        self.cls_head = nn.Linear(config.hidden_size, config.num_labels)
        self.score_head = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        features = torch.tanh(self.encoder(self.embed(input_ids).mean(1)))
        logits = self.cls_head(features)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (n, 8), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--fix", choices=("freeze", "static", "none-unused"))
    opts = parser.parse_args()
    torch.manual_seed(0)
    model = TwoHeadModel(TwoHeadConfig())
    ddp_args = {}
    if opts.fix == "freeze":
        for name in ("score_head.weight", "score_head.bias"):
            model.get_parameter(name).requires_grad_(False)
        ddp_args = {"ddp_find_unused_parameters": False}
    elif opts.fix == "static":
        ddp_args = {"ddp_find_unused_parameters": False, "ddp_static_graph": True}
    elif opts.fix == "none-unused":
        ddp_args = {"ddp_find_unused_parameters": False}
    args = TrainingArguments(output_dir=opts.output_dir, max_steps=6, per_device_train_batch_size=4, use_cpu=True,
                             ddp_backend="gloo", report_to="none", save_strategy="no", dataloader_num_workers=0,
                             disable_tqdm=True, logging_steps=100, **ddp_args)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[DoctorCallback(steps=4)])
    trainer.train()
    # Free the DDP model before the process group goes: gloo (torch 2.13, CPU) otherwise aborts at interpreter exit
    # now and then ("terminate called without an active exception"), with or without ddp-doctor.
    del trainer, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
