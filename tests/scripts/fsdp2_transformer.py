"""A tiny decoder-only transformer trained with FSDP2 the way pytorch/examples' distributed/FSDP2 example and
torchtitan do it: every block sharded, then the root (whose group holds the embeddings, the final norm and the
output head: modules with no fully_shard of their own), a bfloat16 compute / float32 reduce mixed-precision policy,
the optimizer built after sharding, gradient clipping, DCP checkpoints on every rank. Clean.

--steps N            optimizer steps (default 20)
--mixed-precision    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
--save-dir DIR       a DCP checkpoint there every 5 steps
--activation-checkpointing  each block's forward recomputed in backward (torch.utils.checkpoint, non-reentrant)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HEADS, LAYERS, SEQ = 128, 64, 4, 3, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.checkpointed = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return self.out(self.norm(x))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--save-dir", default="")
    parser.add_argument("--activation-checkpointing", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Transformer()
    model.checkpointed = args.activation_checkpointing
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mp_policy": policy} if args.mixed_precision else {}
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if args.save_dir and step % 5 == 4:
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(args.save_dir, f"step{step}"))
        if rank == 0 and step % 5 == 4:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
