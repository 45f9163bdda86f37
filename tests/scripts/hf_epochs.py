"""HF Trainer on a tiny BERT classifier built from a config (no download), evaluated at each epoch end
(eval_strategy="epoch", an eval_dataset, an accuracy from compute_metrics): what `check` follows after its observed
steps. 32 training batches and 16 evaluation batches a rank, 3 epochs. The process group's timeout is 20 s: the
script initializes the group itself, since TrainingArguments(use_cpu=True) drops ddp_timeout (transformers 5.23;
the group then keeps the default 30 min).

--rank0-samples S: a callback on the main process alone also runs the model over a long set (400 batches) at each
epoch end, at S seconds a batch; with S=0.1 the others wait 40 s in the evaluation's first collective and time out.
Usage: torchrun --nproc-per-node 2 hf_epochs.py OUTPUT_DIR [--rank0-samples S]
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("output_dir")
p.add_argument("--rank0-samples", type=float, default=0.0)
opts = p.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 100, (n, 8), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


class Rank0Samples(TrainerCallback):
    """The wrong way: the main process alone runs the model over a long set at each epoch end."""

    def on_epoch_end(self, args, state, control, model=None, **kwargs) -> None:
        if state.is_world_process_zero:
            with torch.no_grad():
                for batch in torch.utils.data.DataLoader(Tokens(1600, 2), batch_size=4):
                    time.sleep(opts.rank0_samples)
                    model(input_ids=batch["input_ids"])


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    training = TrainingArguments(output_dir=opts.output_dir, num_train_epochs=3, per_device_train_batch_size=4,
                                 per_device_eval_batch_size=4, eval_strategy="epoch", use_cpu=True,
                                 ddp_backend="gloo", ddp_find_unused_parameters=False,
                                 report_to="none", save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
                                 logging_steps=1000)
    callbacks = [Rank0Samples()] if opts.rank0_samples else []
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(256, 0), eval_dataset=Tokens(128, 1),
                      compute_metrics=accuracy, callbacks=callbacks)
    trainer.train()
    # Free the DDP model before the process group goes: gloo (torch 2.13, CPU) otherwise aborts at interpreter exit
    # now and then ("terminate called without an active exception"), with or without ddp-doctor.
    del trainer, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
