"""HF Trainer on a tiny BERT classifier built from a config (no download), with DoctorCallback.

Every parameter reaches the loss, yet the Trainer builds DDP with find_unused_parameters=True (its default for a
PreTrainedModel without gradient checkpointing). Usage: torchrun --nproc-per-node 2 hf_bert.py OUTPUT_DIR
"""

from __future__ import annotations

import gc
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from ddp_doctor.integrations.transformers import DoctorCallback


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
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=6, per_device_train_batch_size=4, use_cpu=True,
                             ddp_backend="gloo", report_to="none", save_strategy="no", dataloader_num_workers=0,
                             disable_tqdm=True, logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[DoctorCallback(steps=4)])
    trainer.train()
    # Free the DDP model before the process group goes: gloo (torch 2.13, CPU) otherwise aborts at interpreter exit
    # now and then ("terminate called without an active exception"), with or without ddp-doctor.
    del trainer, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
