"""The fixes of the FSDP2 findings in plain torch and in the words of the framework that runs the job: Accelerate
(its FSDP2 plugin, or a model the script sharded itself) and Lightning (`ModelParallelStrategy`, whose
`configure_model` calls `fully_shard`). Pure: a framework name in, a sentence out.

Measured for Lightning's words, plain torchrun, torch 2.13.0, lightning 2.6, CPU, gloo, 2 ranks
(`tests/scripts/lightning_fsdp2.py`): `trainer.save_checkpoint(path)` on every rank writes a folder with each rank's
shards (two .distcp files and a meta.pt); with `ModelParallelStrategy(save_distributed_checkpoint=False)`
one file holding plain tensors of the full shapes (a [32, 8] weight); under `if trainer.is_global_zero:` alone it
hangs until the job is killed. `ModelParallelStrategy` keeps gradient sync on for every micro-batch of
Lightning's gradient accumulation (its strategy's hook that blocks sync switches off DDP's only).
"""

from __future__ import annotations

__all__ = ["gather_fix", "optimizer_fix", "root_fix", "save_fix", "sync_fix"]

_SAVE_TORCH = (
    "let every rank take part in the save: "
    '`torch.distributed.checkpoint.save({"model": model.state_dict()}, checkpoint_id=ckpt_dir)` on every '
    "rank (each writes its shards; `torch.distributed.checkpoint.load` reads them back, at any world size), or "
    "a full state dict gathered on every rank and written by one: `sd = get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True))` on every rank "
    "(torch.distributed.checkpoint.state_dict), then `if rank == 0: torch.save(sd, path)`."
)
_SAVE_ACCELERATE = (
    " With Accelerate: `accelerator.save_state(ckpt_dir)` on every process, or `sd = "
    "accelerator.get_state_dict(model)` on every process, then `accelerator.save(sd, path)`."
)
_LIGHTNING_EVERY_RANK = (
    "with Lightning, `trainer.save_checkpoint(path)` on every rank, not under `if trainer.is_global_zero:`"
)
_SAVE_LIGHTNING = (
    _LIGHTNING_EVERY_RANK + " (there it waits for the other ranks until the job is killed): ModelParallelStrategy "
    "writes a folder of every rank's "
    "shards, or one file with the full state dict under `ModelParallelStrategy(save_distributed_checkpoint=False)`; "
    "Lightning's ModelCheckpoint callback saves that way. In plain torch: "
)


def save_fix(framework: str) -> str:
    """`sharded-checkpoint-incomplete`'s fix."""
    if framework == "lightning":
        return _SAVE_LIGHTNING + _SAVE_TORCH
    return _SAVE_TORCH + _SAVE_ACCELERATE


def gather_fix(framework: str) -> str:
    """`state-gather-some-ranks`'s fix: every rank enters the gather, one writes."""
    torch_words = (
        "gather on every rank, write on one: `sd = get_model_state_dict(model, "
        "options=StateDictOptions(full_state_dict=True, cpu_offload=True))` outside the `if rank == 0:`, then "
        "`if rank == 0: torch.save(sd, path)`; or save the sharded state with `torch.distributed.checkpoint.save` "
        "on every rank."
    )
    if framework == "lightning":
        return (
            _LIGHTNING_EVERY_RANK
            + ": with `ModelParallelStrategy(save_distributed_checkpoint=False)` it gathers the full state dict on "
            "every rank and writes one file. In plain torch: " + torch_words
        )
    return torch_words + (
        " With Accelerate: `sd = accelerator.get_state_dict(model)` on every process, then "
        "`accelerator.save(sd, path)`."
    )


def optimizer_fix(framework: str, call: str, done: str) -> str:
    """`optimizer-params-replaced`'s fix: build the optimizer after every `call` (`fully_shard`, `replicate`)."""
    torch_words = (
        f"build the optimizer after every {call} call, from the {done} model: "
        f"`for block in model.blocks: {call}(block)`, `{call}(model)`, then "
        "`optimizer = torch.optim.AdamW(model.parameters(), ...)`."
    )
    if framework == "lightning":
        return (
            f"with Lightning, {call} in `configure_model` and build the optimizer in `configure_optimizers` from "
            "`self.parameters()` (Lightning calls it after `configure_model`), never in `__init__`. In plain torch: "
            + torch_words
        )
    return torch_words + (
        " With Accelerate, build the optimizer from the model that accelerator.prepare() returned (or pass both to "
        "prepare together)."
    )


def sync_fix(framework: str, call: str = "set_requires_gradient_sync") -> str:
    """`gradient-sync-off`'s fix: sync back on for the last micro-batch of each optimizer step (`call`: the switch the
    script left off)."""
    torch_words = (
        "switch gradient sync back on for the last micro-batch of each optimizer step: "
        f"`model.{call}(micro_step == accumulation_steps - 1)` before each backward "
        + (
            "(with it off, HSDP accumulates the reduce-scattered gradients across micro-batches; the last one's "
            "all-reduce gives the parameters their gradients)."
            if call == "set_requires_all_reduce"
            else "(the DDP twin is no_sync(), left off for the last micro-batch)."
        )
    )
    if framework == "accelerate":
        return (
            "with Accelerate, `accelerator.no_sync(model)` switches sync off until its block ends: call "
            "optimizer.step() after the block, with the last micro-batch's backward outside it, or let Accelerate "
            "do it: `Accelerator(gradient_accumulation_steps=N)` and `with accelerator.accumulate(model):` around "
            "each micro-batch (sync comes back on for the last one). In plain torch: " + torch_words
        )
    if framework == "lightning":
        return (
            "with Lightning, `Trainer(accumulate_grad_batches=N)` accumulates with sync on (ModelParallelStrategy "
            "does not switch it off); in manual optimization, switch it back on before the last micro-batch's "
            "`self.manual_backward`. In plain torch: " + torch_words
        )
    return torch_words


def root_fix(framework: str, call: str) -> str:
    """`unsharded-params-not-synced`'s fix when the root module was not sharded."""
    torch_words = (
        f"{call} the root as well, after its blocks: `for block in model.blocks: {call}(block)` then "
        f"`{call}(model)`; the root's group holds every parameter left outside the inner groups (the head, "
        "embeddings, final norm)."
    )
    if framework == "lightning":
        return (
            f'with Lightning, end `configure_model` with `{call}(self, mesh=self.device_mesh["data_parallel"])`, '
            f"after the blocks' {call} calls. In plain torch: " + torch_words
        )
    return torch_words
