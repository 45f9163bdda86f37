"""What docs/codes.md adds to a code's one-line meaning (`codes.TABLE`): an example of the title, what the report
names. Drawn by `ddp-doctor codes --markdown docs`; a code without a note has its line alone."""

from __future__ import annotations

from ddp_doctor.core.codes import Code

__all__ = ["NOTES"]

# fmt: off
NOTES: dict[Code, str] = {
    Code.GRADS_NOT_SYNCED: (
        ", and already did after DDP's all-reduce (or no backward of the step was synced: *every backward "
        "pass of these optimizer steps ran under no_sync() (entered at train.py:24)*, with the fix for the "
        "last micro-batch)"
    ),
    Code.RANK_CRASHED: (
        " (from `check`)"
    ),
    Code.RANK_HUNG: (
        " (from `check`)"
    ),
    Code.GRAD_BLOCKED: (
        ": *trunk.weight ran in forward but never got a gradient (reentrant checkpoint at train.py:41 with no"
        " grad-requiring input)*"
    ),
    Code.MODEL_NOT_WRAPPED: (
        ": *no DDP: 4 of 4 trained parameters differ across ranks* (from `check`)"
    ),
    Code.COLLECTIVE_MISMATCH: (
        ": *rank 1 skipped all_reduce (train.py:41) that rank 0 called* (from `check`'s beacons when the job "
        "aborts or hangs); *the ranks issued different collectives in step 0 (rank 1 differs from rank 0)* "
        "(per-step digests, when the job goes on); *rank 0 ran DDP's forward with autograd on and no backward"
        " at eval.py:24 in step 2; rank 1 did not*; *rank 0 broadcast DDP's buffers from a forward without "
        "grad at eval.py:30 in step 2; rank 1 did not* (DDP's own buffer broadcast, counted per step); a "
        "collective one rank skips at an epoch end (see [Collectives the ranks do not agree "
        "on](#collectives-the-ranks-do-not-agree-on))"
    ),
    Code.UNEVEN_INPUTS: (
        ": *ranks have different numbers of batches per epoch (rank 0: 13, rank 1: 12)*, from each loader's "
        "`len()` and from the batches every pass really handed out on each rank (an `IterableDataset` without"
        " `len()` too), naming the loader's line and each rank's count; for an FSDP2 or `replicate` job (no "
        "DDP step record), the training loaders' `len()` per rank when the run ends (or as the cause of a run"
        " that failed after a rank ran out of batches), and a fix without `Join`, which does not cover a "
        "sharded model; and the ranks that drew more batches than the others for one optimizer step (a "
        "`continue` past a batch on some ranks only: they take a step fewer per epoch), for every parallelism"
    ),
    Code.SAMPLER_EPOCH_NOT_SET: (
        ", named by the loader's creation line and the epochs seen: *started a new epoch with the same epoch "
        "(0) (the DataLoader created at train.py:19)*; never for a non-shuffling sampler (evaluation) or a "
        "loader iterated once; for an FSDP2 or `replicate` job, at the epoch the check followed"
    ),
    Code.SHARDS_OVERLAP: (
        ": *the ranks' DistributedSamplers disagree (seed: 0 on rank 0, 1 on rank 1)*, with the loader's line and, "
        "for datasets up to 2,000,000 samples, how many indices rank 0 and the named rank both read in the epoch "
        "and how many no rank reads (computed with torch's own DistributedSampler); or *every rank reads the "
        "whole dataset: its DataLoader has no DistributedSampler (RandomSampler)* when the ranks' datasets "
        "have one digest (a `TensorDataset`'s tensors, a Hugging Face dataset's fingerprint, a torchvision "
        "dataset's root; an unknown dataset is never assumed the same); or samplers of one setting over "
        "different datasets: *the dataset each samples: another subset of one dataset on rank 0 and rank 1 (a "
        "random_split per rank)*"
    ),
    Code.TP_INPUTS_DIFFER: (
        ": *ranks 0 and 1 of one tp group fed different batches at step 0*, with the groups (up to 64 told apart "
        "exactly), the loader's line, and, when the training loader's DistributedSampler holds the world's size, "
        "that as the likely cause"
    ),
    Code.RANK_EXITED: (
        ": *rank 1 exited (status 0) at step 3; rank 0 trained on* (from `check`)"
    ),
    Code.BATCHNORM_NOT_SYNCED: (
        ": *BatchNorm without SyncBatchNorm: 1 layer normalizing over each rank's own batch (6 samples per "
        "rank)*"
    ),
    Code.GRAD_SCALER_MISMATCH: (
        ": *GradScaler's scale differs across ranks at step 0 (rank 0: 65536, rank 1: 1024)*"
    ),
    Code.OPTIMIZER_DIFFERS: (
        ": *the optimizer's lr differs across ranks from step 1*, at a step every rank took, naming the value"
        " on each rank and the scheduler call made on some ranks only"
    ),
    Code.OPTIMIZER_STEP_SKIPPED: (
        ": *rank 1 did not call optimizer.step() in iteration 2; the other ranks did*"
    ),
    Code.GRADS_REDUCED_TWICE: (
        ": *gradients reduced again after DDP reduced them (all_reduce(float32[16, 8])/2 at train.py:24)*, "
        "with the op and the factor"
    ),
    Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER: (
        " (between DDP's wrap or an optimizer step and the next forward): *rank 0 changed the weights between"
        " DDP's wrap and the first forward*, with `load_state_dict`'s line"
    ),
    Code.GRADS_CHANGED_AFTER_SYNC: (
        ": *gradients changed on rank 0 after DDP synchronized them (0.weight and others)*, with the "
        "parameters, the steps and the line of the `clip_grad_norm_` / `clip_grad_value_` call (or that "
        "`.grad` was written in place or replaced, when no clipping call was seen)"
    ),
    Code.PARAM_SHAPES_DIFFER: (
        ": *embed.weight is [9, 16] on rank 0, [11, 16] on rank 1* (from `check`; see [At wrap](#at-wrap)); a layer "
        "frozen on some ranks only before the wrap: *0.weight is trainable on rank 1 only*; when the trainable "
        "shapes line up (each rank freezes another block of the same shape), DDP accepts the model and pairs "
        "different parameters in its all-reduce: *0.weight on 1 of 2 ranks (rank 1 trainable, rank 0 frozen)*, "
        "with the replicas' drift as its consequence"
    ),
    Code.CHECKPOINT_SAME_PATH: (
        ": *2 ranks wrote the same file checkpoints/last.pt with torch.save*, with the ranks and the line "
        "(see [Checkpoints](#checkpoints))"
    ),
    Code.CHECKPOINT_MODULE_PREFIX: (
        ": *the DDP wrapper's state dict was saved to checkpoints/last.pt*"
    ),
    Code.TIMEOUT_RISK: (
        ", after the observed steps: *rank 0 works alone for about 40 s at the loaders' real lengths while "
        "the others wait; the process group's timeout is 20 s*, with the line span, the capped passes in it, "
        "the measured and projected seconds (see "
        "[check.md](check.md#following-the-epoch-ends---follow-epochs---limit-batches))"
    ),
    Code.INPUT_BOUND: (
        ": *the ranks wait for data 80% of each step (17.4 ms of 21.8 ms)*, naming the DataLoader, its "
        "creation line, `num_workers` and `pin_memory` (see [Where the step time "
        "goes](#where-the-step-time-goes))"
    ),
    Code.STRAGGLER_RANK: (
        ": *rank 1 is 20.3x slower; the other ranks wait 30.2 ms per step for it*, naming the phase where its"
        " extra time goes"
    ),
    Code.BACKWARD_PASSES_DIFFER: (
        ": *backward passes through one DDP forward reach different parameters (lightning_gan.py:32, "
        "lightning_gan.py:36)*, naming the parameters some pass leaves out and the line of each backward (see"
        " [Several backward passes through one forward](#several-backward-passes-through-one-forward))"
    ),
    Code.OPTIMIZER_PARAMS_REPLACED: (
        ": *the optimizer steps 6 parameters that are no longer the model's*, with its creation line and "
        "whether any weight changed (from `check`)"
    ),
    Code.UNSHARDED_PARAMS_NOT_SYNCED: (
        " (the root not sharded, a module added after sharding, `ignored_params`, a tensor the optimizer trains "
        "beside the model): *2 parameters outside every fully_shard group differ across ranks* (from `check`)"
    ),
    Code.GRADIENT_SYNC_OFF: (
        ": *gradient sync was off at all 8 optimizer steps*, with the line of the last call (from `check`)"
    ),
    Code.SHARDED_CHECKPOINT_INCOMPLETE: (
        ": *rank 0 alone saved the sharded state dict: ck.pt holds 1 of 2 ranks' shards*, with the line, a "
        "parameter's shard shape against its full shape, and the fix on every rank (from `check`); when the "
        "run then fails (`state_dict()` after an evaluation reshards the root on the saving ranks only, and "
        "the next forward's all-gathers differ), the failure report names the `state_dict()` line"
    ),
    Code.STATE_GATHER_SOME_RANKS: (
        ": *rank 0 gathered the full state dict alone: get_model_state_dict at train.py:58*, with where the "
        "others went instead and what the mismatched collectives did (from `check`, when the run failed)"
    ),
    Code.SHARDED_FORWARD_SOME_RANKS: (
        ": *rank 0 ran a forward through the sharded model that rank 1 did not: train.py:41*, with each "
        "rank's count of forwards at that line and where the others were (from `check`, when the run failed)"
    ),
    Code.LOW_PRECISION_REDUCE: (
        ": *gradients are reduced in bfloat16 while the weights train in float32*, with the difference "
        "measured on one backward against a float32 reduction of the same gradients (from `check`)"
    ),
    Code.UNREGISTERED_PARAMETERS: (
        ": *2 trainable parameters are not in DDP's reducer: head.weight, head.bias, attached at train.py:31 "
        "after DDP was built*, with the step at which they part across ranks, and the parameters the replaced"
        " module left in DDP's reducer (which get no gradient: not a reason to freeze anything); a weight tied "
        "after DDP was built (`model.module.head.weight = model.module.embed.weight`) is named with its line, as "
        "the reason DDP's reducer waits for the tensor the name held before; a model converted after DDP was "
        "built (`model.to(torch.bfloat16)`) is named with that line: *4 parameter(s) were converted from float32 on "
        "cpu to bfloat16 on cpu after DDP was built: DDP no longer syncs their gradients*; a tensor the optimizer "
        "trains beside the model (`SGD([*model.parameters(), temp])`) is named by the script's variable when it "
        "differs across ranks: *the optimizer trains 1 tensor(s) held outside the DDP model (temp)*"
    ),
    Code.NONFINITE_VALUES: (
        ": *the gradients of 4 parameters are NaN or infinite from step 0; the weights already were before "
        "the first step*, with the likely cause (a model materialised from the meta device whose parameters "
        "were never initialised)"
    ),
    Code.TRAINING_STALLED: (
        ": *every gradient was exactly zero at all 8 observed steps*, with the likely cause (a loss that does"
        " not depend on the weights, such as a cross-entropy over a single output column)"
    ),
}
# fmt: on
