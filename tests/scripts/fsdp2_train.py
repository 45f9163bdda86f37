"""A small model trained with FSDP2 (`fully_shard`) on gloo, clean or with one of its silent mistakes.

--mistake none              every Linear and the root sharded, optimizer built after sharding
--mistake optimizer-before  the optimizer is built before fully_shard: it holds the replaced parameters
--mistake root-unsharded    the blocks are sharded, the root (with its head) is not
--mistake sync-off          set_requires_gradient_sync(False) on every micro-batch, never switched back on
--mistake added-after       everything sharded, then a module added to the root and trained (no group holds it)
--mistake accumulate        clean: sync off on the first micro-batch, back on for the last one
--mistake eval-rank0        after the third step, rank 0 alone runs an evaluation forward under no_grad
--mistake eval-every        clean: every rank runs that evaluation forward
--mistake unused-aux        an auxiliary head built before sharding that no forward uses (it never gets a gradient)
--mistake log-rank0         after the third step, rank 0 alone all_reduces the loss to log it
--mistake log-every         clean: every rank all_reduces the loss, rank 0 logs it
--mistake loss-avg-inplace  every step, every rank all_reduces its loss in place and divides it by the world size
                            before backward (autograd passes through the all_reduce: gradients halved)
--mistake log-op-rank0      every step, every rank all_reduces its loss to log it: rank 0 with op=MAX, the others SUM
--mistake log-dtype-rank0   every step, every rank all_reduces its loss to log it: rank 0 as float64, the others
                            float32
--mistake buffer-rank       a constant buffer scaling the input, drawn from each rank's own seed (FSDP2 never
                            broadcasts buffers)
--mistake buffer-same       clean: that buffer drawn from the same seed on every rank
--mistake buffer-stats-rank0 that buffer zero on every rank, then filled on rank 0 alone with the mean of its first
                            batch (input statistics computed on one rank and never broadcast)
--mistake batchnorm         a BatchNorm1d in the first block: its running statistics differ by rank
--mistake clip              clean: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) before each step (a global
                            norm: DTensor gradients reduce their norm across the ranks)
--mistake local-clip        the gradient norm taken from each rank's own shards (`.to_local()`), each rank scaling
                            its shards by its own coefficient
--mistake clip-rank0        clip_grad_norm_ called on rank 0 alone: only its shards are scaled
--mistake value-clip-rank0  clip_grad_value_(model.parameters(), 0.01) on rank 0 alone (elementwise: no collective)
--mistake token-norm        each rank divides its gradient shards by its own batch's count of labels that are not 0
                            (a per-token mean taken after the reduce-scatter, from the rank's own batch)
--mistake lr-zero           the optimizer's learning rate is 0: its steps change nothing
--mistake nan-loss          the loss is NaN from the fourth step on (a log of a negative number, say)
--mistake aux-rank1         at the third step rank 1 alone runs one more forward and backward (an auxiliary
                            objective's pass) before its optimizer step
--mistake nan-rank1         rank 1's batch holds one NaN at the third step (a corrupt sample on one rank)
--mistake zero-loss         the loss is multiplied by 0: every gradient is exactly zero
--mistake same-data         every rank draws its batches from the same seed: the ranks train on the same samples
--mistake head-not-stepped  the optimizer is built over every parameter but the head's: the head gets gradients and
                            never changes
--mistake head-lr-zero      the head in a param group of its own whose learning rate is 0
--mistake head-second-opt   clean: the head in a second optimizer (SGD) of its own, stepped after the first
--mistake sched-rank0       an LR scheduler (StepLR, gamma 0.5) stepped on rank 0 alone from the third step on
--mistake sched-every       clean: that scheduler stepped on every rank
--mistake plateau-local     a ReduceLROnPlateau (patience 1, factor 0.5) stepped on every rank with the rank's own loss
--mistake train-rank0       a Dropout in the first block; after the third step every rank evaluates in eval mode,
                            and rank 0 alone switches back to train mode
--mistake train-every       clean: that evaluation, every rank back in train mode
--mistake skip-rank1        rank 1 alone skips optimizer.step() at the third step (a skip decided from its own loss)
--mistake temperature       a learnable loss temperature kept beside the model, stepped by the same optimizer
--mistake temperature-synced clean: that temperature, its gradient averaged by the script before each step
--mistake temperature-own-opt that temperature stepped by an optimizer of its own (SGD), not the model's
--mistake frozen-model      every parameter of the model frozen before the optimizer is built (with temperature or
                            temperature-synced: the temperature is all it trains, as a prompt tuned on a frozen model)
--mistake keep-unsharded    clean: set_reshard_after_backward(False) on every sharded module (the parameters stay
                            unsharded from the backward to the next forward, the optimizer steps the shards)
--mistake final-eval        clean: after the last step every rank evaluates once under no_grad (FSDP2 leaves the
                            root's parameters unsharded after a forward no backward follows)
--mistake opaque-buffer     a constant buffer held in a tensor subclass whose operations only its own dequantize()
                            supports (rank_buffers.Opaque, as a quantized weight's), equal on every rank

--save (after the third optimizer step, to --save-dir; several at once: "dcp,full"):
  rank0        rank 0 alone: torch.save(model.state_dict(), "ck.pt") (its shards only)
  every-same   every rank torch.save's its state dict to the same "ck.pt"
  every-own    every rank to its own "ck-rank{r}.pt" (a per-rank sharded checkpoint: loadable by the same sharding)
  dcp          torch.distributed.checkpoint.save on every rank
  full         get_model_state_dict(full_state_dict=True, cpu_offload=True) on every rank, rank 0 torch.save's it
  gather-rank0 that full state dict gathered on rank 0 alone (its all-gathers meet rank 1's next forward)
  tensor-rank0 rank 0 alone: torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, "ck.pt")
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 64), nn.ReLU()) for _ in range(2)])
        self.blocks[1][0] = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.extra: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "mix"):
            mix = self.mix.dequantize() if hasattr(self.mix, "dequantize") else self.mix
            x = x * (1 + 0.1 * mix)
        for block in self.blocks:
            x = block(x)
        if self.extra is not None:
            x = x + self.extra(x)
        return self.head(x)


def save(model: nn.Module, rank: int, how: str, folder: str) -> None:
    path = os.path.join(folder, f"ck-rank{rank}.pt" if how == "every-own" else "ck.pt")
    if how == "rank0" and rank == 0 or how in ("every-same", "every-own"):
        torch.save(model.state_dict(), path)
    elif how == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(folder, "dcp"))
    elif how == "full" or how == "gather-rank0" and rank == 0:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(state, path)
    elif how == "tensor-rank0" and rank == 0:
        torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", default="none")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save", default="")
    parser.add_argument("--save-dir", default=".")
    parser.add_argument("--hooks-file", default="", help="rank 0 writes the root's forward hooks at each step here")
    args = parser.parse_args()
    mistakes = set(args.mistake.split(","))  # several at once: "accumulate,eval-every"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    model.aux = nn.Linear(64, 4) if "unused-aux" in mistakes else None  # in the root's group, never called
    if "buffer-rank" in mistakes or "buffer-same" in mistakes:
        seed = rank if "buffer-rank" in mistakes else 0
        model.register_buffer("mix", torch.randn(16, generator=torch.Generator().manual_seed(seed)), persistent=False)
    if "opaque-buffer" in mistakes:
        from rank_buffers import Opaque

        model.register_buffer("mix", Opaque(torch.ones(16)), persistent=False)
    if "buffer-stats-rank0" in mistakes:
        model.register_buffer("mix", torch.zeros(16), persistent=False)
    if "batchnorm" in mistakes:
        model.blocks[0].insert(1, nn.BatchNorm1d(64))
    if "train-rank0" in mistakes or "train-every" in mistakes:
        model.blocks[0].append(nn.Dropout(0.2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if "optimizer-before" in mistakes:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for block in model.blocks:
        fully_shard(block)
    if "root-unsharded" not in mistakes:
        fully_shard(model)
    if "keep-unsharded" in mistakes:  # ZeRO-2 style: the parameters stay gathered from backward to the next forward
        model.set_reshard_after_backward(False)
    if "added-after" in mistakes:
        model.extra = nn.Linear(64, 64)
        before.update({f"extra.{n}": p.detach().clone() for n, p in model.extra.named_parameters()})
    head_opt = temp = None
    if "optimizer-before" not in mistakes:
        params = list(model.parameters())
        head = [p for n, p in model.named_parameters() if n.startswith("head.")]
        rest = [p for p in params if all(p is not h for h in head)]
        if "head-not-stepped" in mistakes:
            params = rest
        elif "head-lr-zero" in mistakes:
            params = [{"params": rest}, {"params": head, "lr": 0.0}]
        elif "head-second-opt" in mistakes:
            params, head_opt = rest, torch.optim.SGD(head, lr=0.1)
        if "frozen-model" in mistakes:
            model.requires_grad_(False)
        temp = nn.Parameter(torch.zeros(())) if {"temperature", "temperature-synced", "temperature-own-opt"} & mistakes else None
        if "temperature-own-opt" in mistakes:
            head_opt = torch.optim.SGD([temp], lr=0.1)
        elif temp is not None:
            params = params + [temp]
        opt = torch.optim.AdamW(params, lr=0.0 if "lr-zero" in mistakes else 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    g = torch.Generator().manual_seed(0 if "same-data" in mistakes else rank)
    first_batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(0 if "same-data" in mistakes else rank))
    if "buffer-stats-rank0" in mistakes and rank == 0:
        model.mix.copy_(first_batch.mean(0))  # the input statistics, computed where the data was read
    print(f"rank {rank}: first batch sum {first_batch.double().sum().item():.6f}", flush=True)
    for _step in range(args.steps):
        for micro in range(2):
            if "sync-off" in mistakes:
                model.set_requires_gradient_sync(False)
            if "accumulate" in mistakes:
                model.set_requires_gradient_sync(micro == 1)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            if "nan-rank1" in mistakes and rank == 1 and _step == 2 and micro == 0:
                x[0, 0] = float("nan")  # one corrupt sample in rank 1's data
            loss = F.cross_entropy(model(x) / (temp.exp() if temp is not None else 1.0), y) * (0.0 if "zero-loss" in mistakes else 1.0)
            if "nan-loss" in mistakes and _step >= 3:
                loss = loss * float("nan")
            if "loss-avg-inplace" in mistakes:  # averaged across ranks in place before backward
                dist.all_reduce(loss)
                loss = loss / dist.get_world_size()
            loss.backward()
        if "aux-rank1" in mistakes and rank == 1 and _step == 2:  # an auxiliary objective's pass, on rank 1 alone
            F.cross_entropy(model(torch.randn(8, 16, generator=g)), y).backward()
        if "clip" in mistakes or "clip-rank0" in mistakes and rank == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if "value-clip-rank0" in mistakes and rank == 0:
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        if "token-norm" in mistakes:
            tokens = max(int((y != 0).sum()), 1)
            for p in model.parameters():
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).div_(tokens)
        if "local-clip" in mistakes:
            local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(shard) for shard in local]))
            for shard in local:
                shard.mul_((0.05 / (norm + 1e-6)).clamp(max=1.0))
        if "temperature-synced" in mistakes:
            dist.all_reduce(temp.grad)
            temp.grad /= dist.get_world_size()
        if not ("skip-rank1" in mistakes and rank == 1 and _step == 2):
            opt.step()
        opt.zero_grad()
        if head_opt is not None:
            head_opt.step()
            head_opt.zero_grad()
        if args.hooks_file and rank == 0:
            with open(args.hooks_file, "a") as f:
                f.write(f"{_step} {len(model._forward_hooks)}\n")
        if _step >= 2 and ("sched-every" in mistakes or "sched-rank0" in mistakes and rank == 0):
            sched.step()
        if "plateau-local" in mistakes:
            plateau.step(loss.item())
        if _step == 2 and ("log-every" in mistakes or "log-rank0" in mistakes and rank == 0):
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {_step}: loss {mean.item() / dist.get_world_size():.4f}", flush=True)
        if {"log-op-rank0", "log-dtype-rank0"} & mistakes:  # the loss reduced for logging, rank 0 differently
            total = loss.detach().clone().to(torch.float64 if "log-dtype-rank0" in mistakes and rank == 0 else None)
            dist.all_reduce(total, op=dist.ReduceOp.MAX if "log-op-rank0" in mistakes and rank == 0 else dist.ReduceOp.SUM)
            if _step == args.steps - 1:
                print(f"rank {rank}: loss {loss.item():.6f}, logged {total.item():.6f}", flush=True)
        for how in args.save.split(",") if _step == 2 and args.save else []:
            save(model, rank, how, args.save_dir)
        if _step == 2 and ("eval-every" in mistakes or "eval-rank0" in mistakes and rank == 0):
            with torch.no_grad():
                model(torch.randn(4, 16, generator=g))
        if _step == 2 and ("train-rank0" in mistakes or "train-every" in mistakes):
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 16, generator=g))
            if rank == 0 or "train-every" in mistakes:
                model.train()
    # The ground truth, printed by each rank: how far each parameter moved, and its head's sum (compare across ranks).
    moved = max(
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().sub(before[n]).abs().max().item()
        for n, p in model.named_parameters()
    )
    head = model.head.weight
    head_sum = (head.full_tensor() if hasattr(head, "full_tensor") else head).detach().double().sum().item()
    extra = f", extra.weight sum {model.extra.weight.detach().double().sum().item():.6f}" if model.extra else ""
    if {"head-not-stepped", "head-lr-zero", "head-second-opt"} & mistakes:
        weight = model.head.weight
        change = (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).detach() - before["head.weight"]
        extra += f", head.weight change {change.abs().max().item():.3g}"
    if "final-eval" in mistakes:
        with torch.no_grad():
            extra += f", evaluated {model(torch.ones(2, 16)).double().sum().item():.6f}"
    if hasattr(model, "mix"):  # every rank runs it: the forward all-gathers
        with torch.no_grad():
            extra += f", output sum on ones {model(torch.ones(2, 16)).double().sum().item():.6f}"
    if {"sched-rank0", "sched-every", "plateau-local"} & mistakes:
        extra += f", lr {opt.param_groups[0]['lr']:.3g}"
    if "train-rank0" in mistakes or "train-every" in mistakes:
        extra += f", training {model.blocks[0].training}"
    if temp is not None:
        extra += f", temperature {temp.item():.6f}"
    print(f"rank {rank}: largest weight change {moved:.3g}, head.weight sum {head_sum:.6f}{extra}", flush=True)
    dist.destroy_process_group()
