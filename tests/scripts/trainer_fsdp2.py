"""A tiny GPT-2 (built from a config, nothing downloaded) trained by the HF Trainer with FSDP version 2
(`fsdp="full_shard"`, `fsdp_config={"fsdp_version": 2}`). The Trainer's FSDP goes through Accelerate, which uses it
only on GPUs, so this runs on a GPU machine (the GPU-only tests)."""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=False)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        report_to=[],
        save_strategy="no",
        logging_steps=4,
    )
    Trainer(model=model, args=training, train_dataset=Tokens(64)).train()
