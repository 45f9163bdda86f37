"""A rank's crash: how the observed loop ended early, and DDP's own errors explained with names (local data only)."""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.codes import Code
from ddp_doctor.core.errors import DDPFailure, ReductionError
from ddp_doctor.core.frames import user_frame
from ddp_doctor.core.records import CRASH_KINDS, ModelInfo, RankRecord

__all__ = ["OBSERVE_HINT", "CrashLog", "classify", "explain_failure", "raising_ddp"]


def raising_ddp(exc: BaseException) -> DistributedDataParallel | None:
    """The innermost DDP instance whose method is on the traceback of `exc`, or of the DDP error an already explained
    `DDPFailure` wraps (None when none is)."""
    if isinstance(exc, DDPFailure) and exc.__cause__ is not None:
        exc = exc.__cause__
    found, tb = None, exc.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, DistributedDataParallel):
            found = candidate
        tb = tb.tb_next
    return found


def classify(exc: BaseException) -> str:
    """The kind of a crash, one of `records.CRASH_KINDS` (but "none"), from DDP's error text."""
    if isinstance(exc, SystemExit):
        return "exit"  # the script's sys.exit with a failure status
    text = str(exc)
    if "graph has changed" in text:
        return "static-graph-changed"
    # Lightning's DDP strategy rewrites DDP's reduction error in place (`on_exception`) before re-raising it.
    if "Expected to have finished reduction" in text or "LightningModule has parameters that were not used" in text:
        return Code.REDUCTION_ERROR
    if "mark a variable ready only once" in text:
        return "mark-ready-twice"
    if isinstance(exc, RuntimeError) and "DistributedDataParallel" in text:
        return "ddp-other"
    return "other"


OBSERVE_HINT = " Call doctor.report() on every rank for the full diagnosis."
"""What the in-process API adds to an explained failure; `ddp-doctor check` reports by itself and passes ""."""


def explain_failure(
    exc: BaseException,
    *,
    kind: str,
    rank: int,
    info: ModelInfo,
    record: RankRecord,
    crash_in_window: bool,
    hint: str = OBSERVE_HINT,
) -> DDPFailure:
    """A ddp_doctor error that says, with names, what DDP's error means on this rank.

    Args:
        exc: DDP's error.
        kind: its class from `classify`.
        rank: this rank.
        info: the model.
        record: this rank's observed steps so far (the crashed step last, marked incomplete).
        crash_in_window: whether the error came while steps were still being observed.
        hint: the sentence that ends the message (what to do next in the caller's context).
    """
    complete = [i for i, c in enumerate(record.counter("complete").tolist()) if c]
    # The crashed step (last, incomplete) had a backward pass through the forward that failed in a later one.
    if record.steps and not record.counter("complete")[-1] and int(record.counter("split_passes")[-1]):
        return _second_pass_failure(exc, kind, rank=rank, info=info, record=record, hint=hint)
    if kind == "mark-ready-twice":
        seen = record.steps > 0
        used = record.used[-1] if seen else torch.zeros(len(info.param_names), dtype=torch.bool)
        reach = record.reachable[-1] if seen else used
        named = set(re.findall(r"with name (\S+)", str(exc)))
        names = [n for i, n in enumerate(info.param_names) if (used[i] and not reach[i]) or n in named]
        reentrant = seen and bool(record.counter("reentrant_checkpoints")[-1])
        where = (
            "inside reentrant activation checkpointing (use_reentrant=True)" if reentrant else "outside DDP's forward"
        )
        return DDPFailure(
            f"DDP failed on rank {rank}: with find_unused_parameters=True a parameter was marked ready "
            f"twice. These parameters got a gradient but are not part of the graph of DDP's forward outputs, "
            f"because they are used {where}: {_names(names)}. Fix: build DDP with static_graph=True and "
            f"find_unused_parameters=False"
            + (", or use use_reentrant=False" if reentrant else ", or compute them inside forward")
            + "."
            + hint,
            code=Code.REENTRANT_CHECKPOINT if reentrant else Code.USED_OUTSIDE_FORWARD,
            params=names,
        )
    if complete and crash_in_window:
        last = complete[-1]
        used = record.used[last]
        trainable = record.trainable[last]
        names = [n for i, n in enumerate(info.param_names) if info.trainable_at_wrap[i] and not used[i]]
        frozen = [n for i, n in enumerate(info.param_names) if info.trainable_at_wrap[i] and not trainable[i]]
        where = f"in step {last}"
    else:
        names = _names_from_torch_message(str(exc), info)
        frozen = []
        where = "after the observed steps" if complete else "before observe() saw a full step"
    if kind == "static-graph-changed":
        return DDPFailure(
            f"DDP failed on rank {rank}: static_graph=True, but the set of parameters that reach the loss "
            f"changed between steps. Parameters with no gradient {where}: {_names(names)}. Fix: build DDP "
            f"with static_graph=False and find_unused_parameters=True (the graph is dynamic).{hint}",
            code=Code.STATIC_GRAPH_UNSAFE,
            params=names,
        )
    # This rank's own record shows which of them the script trains: a gradient in another step, or a module that
    # ran. Freezing is never the advice for those (what other ranks did is only known after the exchange).
    trained = (
        [
            n
            for i, n in enumerate(info.param_names)
            if n in set(names) and bool((record.used[:, i] | record.ran[:, i]).any())
        ]
        if record.steps
        else []
    )
    if frozen:
        cause = (
            f"these parameters were frozen after DDP was built: {_names(frozen)}. Fix: set requires_grad=False "
            f"before wrapping the model (or rebuild DDP after freezing)"
        )
    elif trained:
        cause = (
            f"The script trains {_names(trained)}: on this rank they got a gradient in another step, or "
            "their module ran. Fix: keep them trainable; if the same ones are unused at every step, build "
            "DDP with static_graph=True; if the set changes from step to step, use "
            "find_unused_parameters=True"
        )
    else:
        cause = (
            "Fix: if they are never meant to train, set requires_grad=False before wrapping; if the same "
            "ones are unused every step, build DDP with static_graph=True; if the set changes from step to "
            "step, use find_unused_parameters=True"
        )
    return ReductionError(
        f"DDP failed on rank {rank}: 'Expected to have finished reduction in the prior iteration'. DDP "
        f"waited for gradients that never came. Trainable parameters that received no gradient {where}: "
        f"{_names(names)}. {cause}.{hint}",
        code=Code.REDUCTION_ERROR,
        params=names,
    )


def _second_pass_failure(
    exc: BaseException, kind: str, *, rank: int, info: ModelInfo, record: RankRecord, hint: str
) -> DDPFailure:
    """DDP failed in a second backward pass through one forward (a GAN's two losses from one forward)."""
    sites = [site.split(": ", 1)[-1] for site in record.pass_sites]
    where = f" ({', '.join(sites)})" if sites else ""
    used = record.used[-1]
    if kind == Code.REDUCTION_ERROR:
        names = [n for i, n in enumerate(info.param_names) if info.trainable_at_wrap[i] and not used[i]]
        return ReductionError(
            f"DDP failed on rank {rank}: 'Expected to have finished reduction' at a second backward pass through one "
            f"forward{where}. The framework prepares DDP's reduction at each backward pass (Lightning's "
            f"manual_backward), and the first pass gave no gradient to {_names(names)}, which a later pass trains. "
            'Fix: find_unused_parameters=True (Lightning: strategy="ddp_find_unused_parameters_true"); '
            f"static_graph=True fails on this pattern too.{hint}",
            code=Code.REDUCTION_ERROR,
            params=names,
        )
    named = set(re.findall(r"with name (\S+)", str(exc)))
    names = [n for i, n in enumerate(info.param_names) if i in set(record.split_params) or n in named]
    return DDPFailure(
        f"DDP failed on rank {rank}: two backward passes through one forward{where} reach different parameters, and "
        f"DDP prepares one reduction per forward: a parameter reached by both passes is marked ready twice "
        f"(parameters involved: {_names(names)}). No DDP flag fixes this "
        "(find_unused_parameters=True and static_graph=True fail too). Fix: give each backward pass its own forward "
        f"through the DDP model, or wrap the generator and the discriminator in DDP models of their own.{hint}",
        code=Code.BACKWARD_PASSES_DIFFER,
        params=names,
    )


def _names(names: list[str], limit: int = 8) -> str:
    if not names:
        return "(none identified)"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _names_from_torch_message(text: str, info: ModelInfo) -> list[str]:
    """Map DDP's 'Parameter indices which did not receive grad for rank R: i j' onto names."""
    marker = "did not receive grad for rank"
    if marker not in text:
        return []
    tail = text.split(marker, 1)[1].split(":", 1)[-1].split("\n", 1)[0]
    reduced = [n for n, t in zip(info.param_names, info.trainable_at_wrap) if t]
    out = []
    for token in tail.split():
        if token.isdigit() and int(token) < len(reduced):
            out.append(reduced[int(token)])
        elif not token.isdigit():
            out.append(token)
    return out


@dataclass(kw_only=True, slots=True)
class CrashLog:
    """How this rank's observed loop ended early, if it did (what a `RankRecord` carries about it)."""

    kind: int = 0
    """Index into `records.CRASH_KINDS`; 0: no crash."""
    step: int = -1
    """The step the crash interrupted (the number of steps closed before it)."""
    message: str = ""
    site: str = ""
    """`file:line  code` of the user's innermost frame on the traceback."""
    in_window: bool = False
    """The crash came while steps were still observed (the hooks were attached)."""

    @property
    def kind_name(self) -> str:
        return CRASH_KINDS[self.kind]

    def note(
        self, exc: BaseException, *, step: int, in_window: bool, ddp: DistributedDataParallel | None = None
    ) -> bool:
        """Record `exc` unless a crash is already recorded. Returns whether it was recorded.

        A DDP error raised by another DDP model than `ddp` (a GAN's critic failing while its generator is observed
        too) ended this model's loop, but is not this model's failure: it is recorded as "other-model".
        """
        if self.kind:
            return False
        kind = classify(exc)
        if kind != "other" and ddp is not None:
            raiser = raising_ddp(exc)
            if raiser is not None and raiser is not ddp:
                kind = "other-model"
        self.kind = CRASH_KINDS.index(kind)
        self.step = step
        self.in_window = in_window
        self.message = f"{type(exc).__name__}: {exc}"[:4000]
        self.site = user_frame(traceback.extract_tb(exc.__traceback__)) or ""
        return True

    def stamp(self, record: RankRecord) -> None:
        """Copy the crash into `record`."""
        record.crash_kind, record.crash_step, record.crash_message = self.kind, self.step, self.message
        record.crash_site = self.site
