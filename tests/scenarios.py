"""The scenario matrix: one small model and loop per DDP situation, with the findings each must produce.

Each case runs twice inside one launch: first as the user wrote it (observed), then with the report's
recommendation applied (and the loop's bug fixed where flags cannot fix it), checking at every optimizer step that
grads are identical across ranks and equal to the average of the per-rank local grads.

The model and batches live on `device()`: the CPU, or each rank's GPU when `DDP_DOCTOR_TEST_DEVICE=cuda` (the
GPU-only tests; the backend is then NCCL or gloo, see tests/dist.py).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from checkrun import assert_clean_reports_say_what_they_compared
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from ddp_doctor import DDPFailure, observe


class Net(nn.Module):
    """A trunk, two heads and an optional checkpointed block; `mode` picks which parts reach the loss."""

    def __init__(self, *, checkpointed: str | None = None, batchnorm: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)
        self.norm = nn.BatchNorm1d(16) if batchnorm else None
        self.checkpointed = checkpointed

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.trunk(x))

    def forward(self, x: torch.Tensor, use_b: bool = False, return_features: bool = False) -> Any:
        if self.checkpointed in ("reentrant-input", "non-reentrant-input"):
            # Memory-saving checkpointing of the first layer, whose input (the batch) does not require grad.
            h = checkpoint(self.stem, x, use_reentrant=self.checkpointed == "reentrant-input")
        else:
            h = self.stem(x)
        if self.norm is not None:
            h = self.norm(h)
        if self.checkpointed is None or self.checkpointed.endswith("-input"):
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.checkpointed == "reentrant")
        out = self.head_a(h)
        if use_b:
            out = out + self.head_b(h)
        return (out, h) if return_features else out


def device() -> torch.device:
    """Where this rank's model and batches live."""
    if os.environ.get("DDP_DOCTOR_TEST_DEVICE") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batch(rank: int, step: int, micro: int = 0, *, same: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed((0 if same else 1000 * rank) + 10 * step + micro + 1)
    return torch.randn(6, 8, generator=g).to(device()), torch.randn(6, 4, generator=g).to(device())


LossFn = Callable[[Any, nn.Module, tuple[torch.Tensor, torch.Tensor], int, int], torch.Tensor]


def loss_plain(model: Any, inner: nn.Module, data: Any, step: int, rank: int) -> torch.Tensor:
    x, y = data
    return F.mse_loss(model(x), y)


def loss_both(model: Any, inner: nn.Module, data: Any, step: int, rank: int) -> torch.Tensor:
    x, y = data
    return F.mse_loss(model(x, use_b=True), y)


def loss_odd_steps(model: Any, inner: nn.Module, data: Any, step: int, rank: int) -> torch.Tensor:
    x, y = data
    return F.mse_loss(model(x, use_b=step % 2 == 1), y)


def loss_rank0_only(model: Any, inner: nn.Module, data: Any, step: int, rank: int) -> torch.Tensor:
    x, y = data
    return F.mse_loss(model(x, use_b=rank == 0), y)


def loss_outside_forward(model: Any, inner: nn.Module, data: Any, step: int, rank: int) -> torch.Tensor:
    x, y = data
    out, h = model(x, return_features=True)
    return F.mse_loss(out, y) + 0.1 * inner.head_b(h).pow(2).mean()  # head_b runs after DDP's forward


def loss_bypass(model: Any, inner: nn.Module, data: Any, step: int, rank: int) -> torch.Tensor:
    x, y = data
    return F.mse_loss(inner(x, use_b=True), y)  # the loss goes through ddp.module: DDP never syncs


def freeze(*names: str) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        for n in names:
            module.get_parameter(n).requires_grad_(False)

    return apply


def unfreeze(*names: str) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        for n in names:
            module.get_parameter(n).requires_grad_(True)

    return apply


@dataclass(kw_only=True)
class Case:
    name: str
    codes: set[str]
    """The exact set of finding codes the observed run must produce."""
    params: dict[str, set[str]] = field(default_factory=dict)
    """Per code, the exact parameter (or buffer) names the finding must name."""
    loss: LossFn = loss_both
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    net_kwargs: dict[str, Any] = field(default_factory=dict)
    before_wrap: Callable[[nn.Module], None] | None = None
    after_wrap: Callable[[nn.Module], None] | None = None
    accumulate: str | None = None
    """None, "flag" (nanoGPT's require_backward_grad_sync) or "no_sync"."""
    micro_steps: int = 1
    same_batch: bool = False
    raises: str | None = None
    """The ddp_doctor error code the observed loop must raise, if it crashes."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """Changes to the loop for the applied run, where the bug is in code rather than in flags."""
    steps: int = 4
    retry_on_rank: int | None = None
    """This rank runs one more synced forward and backward through DDP in step 1, the others in step 2."""
    log_metric: str | None = None
    """Each rank all-reduces its loss for logging after the backward: "sum" on every rank, or "max-on-rank-1" (rank
    1 asks for MAX while the others SUM: the calls pair up, the results are silently wrong)."""
    scaler: str | None = None
    """AMP's GradScaler around the step: "same" on every rank, or "rank-1-init" (rank 1 builds it with another
    init_scale, so the ranks skip different steps)."""
    compile: str | None = None
    """torch.compile (dynamo's "eager" backend: tracing without code generation): "inside" DDP (DDP around the
    compiled module) or "outside" (the compiled DDP)."""
    groups: list[list[int]] | None = None
    """Data-parallel groups over which DDP is built (DDP(process_group=...)), as in hybrid-parallel jobs; each group
    gets its own weights. None: the world."""
    loss_by_group: list[LossFn] | None = None
    """The loss of each group, when the groups train differently."""
    evaluate: str | None = None
    """Rank 0 evaluates before step 1: "grad" through the DDP wrapper with autograd on, "no_grad" the right way
    (under torch.no_grad() through ddp.module)."""


HEAD_B = {"head_b.weight", "head_b.bias"}
TRUNK = {"trunk.weight", "trunk.bias"}
BLOCK = {"block.0.weight", "block.0.bias"}
ALL = TRUNK | BLOCK | {"head_a.weight", "head_a.bias"} | HEAD_B

CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case(name="all-used", codes=set()),
        Case(
            name="unused-head",
            loss=loss_plain,
            raises="reduction-error",
            codes={"reduction-error", "unused-parameters", "grads-not-synced", "replica-divergence"},
            params={"reduction-error": HEAD_B, "unused-parameters": HEAD_B},
        ),
        Case(
            name="unused-head-find-unused",
            loss=loss_plain,
            ddp_kwargs={"find_unused_parameters": True},
            codes={"unused-parameters"},
            params={"unused-parameters": HEAD_B},
        ),
        Case(
            name="odd-steps-head",
            loss=loss_odd_steps,
            ddp_kwargs={"find_unused_parameters": True},
            codes={"dynamic-graph"},
            params={"dynamic-graph": HEAD_B},
        ),
        Case(
            name="odd-steps-static-graph",
            loss=loss_odd_steps,
            ddp_kwargs={"static_graph": True},
            raises="static-graph-unsafe",
            codes={"static-graph-unsafe", "dynamic-graph"},
            params={"dynamic-graph": HEAD_B, "static-graph-unsafe": HEAD_B},
        ),
        Case(
            name="one-rank-head",
            loss=loss_rank0_only,
            ddp_kwargs={"find_unused_parameters": True},
            codes={"rank-dependent-graph"},
            params={"rank-dependent-graph": HEAD_B},
        ),
        Case(
            name="outside-forward",
            loss=loss_outside_forward,
            codes={"used-outside-forward"},
            params={"used-outside-forward": HEAD_B},
        ),
        Case(
            name="outside-forward-find-unused",
            loss=loss_outside_forward,
            ddp_kwargs={"find_unused_parameters": True},
            raises="used-outside-forward",
            codes={"used-outside-forward"},
            # DDP fails at the first gradient that arrives; only that one is known to be used outside forward.
            params={"used-outside-forward": {"head_b.bias"}},
        ),
        Case(
            name="reentrant-checkpoint",
            net_kwargs={"checkpointed": "reentrant"},
            codes={"reentrant-checkpoint"},
            params={"reentrant-checkpoint": BLOCK},
        ),
        Case(
            name="reentrant-checkpoint-find-unused",
            net_kwargs={"checkpointed": "reentrant"},
            ddp_kwargs={"find_unused_parameters": True},
            raises="reentrant-checkpoint",
            codes={"reentrant-checkpoint"},
            params={"reentrant-checkpoint": {"block.0.bias"}},
        ),
        Case(
            name="reentrant-checkpoint-unused",
            loss=loss_plain,
            net_kwargs={"checkpointed": "reentrant"},
            raises="reduction-error",
            codes={
                "reduction-error",
                "reentrant-checkpoint",
                "unused-parameters",
                "grads-not-synced",
                "replica-divergence",
            },
            params={"reentrant-checkpoint": BLOCK, "unused-parameters": HEAD_B, "reduction-error": HEAD_B},
        ),
        Case(name="nonreentrant-checkpoint", net_kwargs={"checkpointed": "non-reentrant"}, codes=set()),
        # Reentrant checkpointing of a block whose input does not require grad: the block gets no gradient at all.
        # Its parameters look unused, but the module ran: grad-blocked, never "freeze them".
        Case(
            name="reentrant-checkpoint-no-grad-input",
            net_kwargs={"checkpointed": "reentrant-input"},
            raises="reduction-error",
            codes={"grad-blocked", "reentrant-checkpoint", "reduction-error", "grads-not-synced", "replica-divergence"},
            params={"grad-blocked": TRUNK, "reentrant-checkpoint": TRUNK, "reduction-error": TRUNK},
            fixed={"net_kwargs": {"checkpointed": "non-reentrant-input"}},
        ),
        Case(
            name="nonreentrant-checkpoint-no-grad-input",
            net_kwargs={"checkpointed": "non-reentrant-input"},
            codes=set(),
        ),
        Case(
            name="nonreentrant-checkpoint-unused",
            loss=loss_plain,
            net_kwargs={"checkpointed": "non-reentrant"},
            raises="reduction-error",
            codes={"reduction-error", "unused-parameters", "grads-not-synced", "replica-divergence"},
            params={"unused-parameters": HEAD_B},
        ),
        Case(name="find-unused-unneeded", ddp_kwargs={"find_unused_parameters": True}, codes={"find-unused-unneeded"}),
        Case(
            name="loss-through-module",
            loss=loss_bypass,
            codes={"wrapper-bypass", "grads-not-synced", "replica-divergence"},
            params={"grads-not-synced": ALL, "replica-divergence": ALL},
            fixed={"loss": loss_both},
        ),
        Case(
            name="freeze-after-wrap",
            after_wrap=freeze("trunk.weight", "trunk.bias"),
            raises="reduction-error",
            codes={"frozen-after-wrap", "reduction-error", "grads-not-synced", "replica-divergence"},
            params={"frozen-after-wrap": TRUNK, "reduction-error": TRUNK},
            fixed={"after_wrap": None},
        ),
        # Frozen after wrap but before the first step, static_graph=True records them as unused: wasted communication
        # (a warning); once a step has trained them, the same freeze fails like default flags (tests/fixes/test_guard.py).
        Case(
            name="freeze-after-wrap-static-graph",
            after_wrap=freeze("trunk.weight", "trunk.bias"),
            ddp_kwargs={"static_graph": True},
            codes={"frozen-after-wrap"},
            params={"frozen-after-wrap": TRUNK},
            fixed={"after_wrap": None},
        ),
        Case(
            name="unfreeze-after-wrap",
            before_wrap=freeze("trunk.weight", "trunk.bias"),
            after_wrap=unfreeze("trunk.weight", "trunk.bias"),
            codes={"unfrozen-after-wrap", "grads-not-synced", "replica-divergence"},
            params={"unfrozen-after-wrap": TRUNK, "grads-not-synced": TRUNK, "replica-divergence": TRUNK},
            fixed={"before_wrap": None, "after_wrap": None},
        ),
        Case(name="accumulate-nanogpt", accumulate="flag", micro_steps=3, codes=set()),
        Case(name="accumulate-no-sync", accumulate="no_sync", micro_steps=3, codes=set()),
        Case(name="same-batch", same_batch=True, codes={"identical-inputs-across-ranks"}, fixed={"same_batch": False}),
        # BatchNorm in training mode, each rank over its own batch of 6: information, with the per-rank batch size.
        Case(name="batchnorm", net_kwargs={"batchnorm": True}, codes={"batchnorm-not-synced"}),
        # The same layer in eval mode (frozen statistics, as in fine-tuning): nothing to say.
        Case(
            name="batchnorm-eval", net_kwargs={"batchnorm": True}, after_wrap=lambda net: net.norm.eval(), codes=set()
        ),
        # AMP's GradScaler: the same on every rank is clean; a rank-dependent init_scale is named at the first step.
        Case(name="grad-scaler", scaler="same", codes=set(), fixed={"scaler": None}),
        # DDP averages gradients scaled by different factors; each rank unscales by its own: the replicas diverge.
        Case(
            name="grad-scaler-rank-dependent",
            scaler="rank-1-init",
            codes={"grad-scaler-mismatch", "replica-divergence"},
            fixed={"scaler": None},
        ),
        # A retry path that runs one more forward and backward through DDP on rank 1: DDP's all-reduces pair across
        # steps. Named as a collective mismatch at the step it happened, with the rank.
        # The paired all-reduces average the same gradients on both ranks (so grads agree at each optimizer step),
        # but of different micro-passes: the weights drift apart.
        # Counted in lockstep (DDP's synced passes, which pair up across ranks), rank 1 takes no optimizer step after
        # the pass in which rank 0 steps: a step skipped in that iteration, not an extra collective (issue #25).
        Case(
            name="extra-backward-on-one-rank",
            retry_on_rank=1,
            codes={"optimizer-step-skipped", "replica-divergence"},
            fixed={"retry_on_rank": None},
        ),
        # A rank-0-only evaluation through the DDP wrapper with autograd on: the ranks' DDP calls differ. Harmless here
        # (no buffers to broadcast), so a warning that says why; the right way (no_grad through .module) stays clean.
        Case(
            name="eval-rank0-through-ddp-in-grad-mode",
            evaluate="grad",
            codes={"collective-mismatch"},
            fixed={"evaluate": "no_grad"},
        ),
        Case(name="eval-rank0-no-grad-through-module", evaluate="no_grad", codes=set()),
        # The script's own collectives, compared per step through a digest: the same logging all_reduce everywhere is
        # clean; a different reduction on one rank pairs up silently and is named.
        Case(name="logging-all-reduce", log_metric="sum", codes=set()),
        Case(
            name="logging-all-reduce-other-op-on-rank-1",
            log_metric="max-on-rank-1",
            codes={"collective-mismatch"},
            fixed={"log_metric": "sum"},
        ),
        # torch.compile on either side of DDP: names without the `_orig_mod.` prefix, the recommendation applied to the
        # compiled model.
        Case(
            name="compiled-inside-ddp-unused-head",
            compile="inside",
            loss=loss_plain,
            ddp_kwargs={"static_graph": True},
            codes={"unused-parameters"},
            params={"unused-parameters": HEAD_B},
        ),
        Case(
            name="compiled-ddp-unused-head",
            compile="outside",
            loss=loss_plain,
            ddp_kwargs={"static_graph": True},
            codes={"unused-parameters"},
            params={"unused-parameters": HEAD_B},
        ),
        Case(
            name="batchnorm-no-broadcast",
            net_kwargs={"batchnorm": True},
            ddp_kwargs={"broadcast_buffers": False},
            codes={"buffer-divergence", "batchnorm-not-synced"},
            params={"buffer-divergence": {"norm.running_mean", "norm.running_var"}},
        ),
    ]
}


def group_index(case: Case, rank: int) -> int:
    """The data-parallel group `rank` belongs to (0 without groups)."""
    return next((i for i, g in enumerate(case.groups or []) if rank in g), 0)


def _group(case: Case, rank: int) -> Any:
    """This rank's process group (every rank creates every group, in the same order, as new_group requires)."""
    if case.groups is None:
        return None
    made = [dist.new_group(g) for g in case.groups]
    return made[group_index(case, rank)]


def _build(case: Case, ddp_kwargs: dict[str, Any], freeze_names: list[str]) -> tuple[Any, torch.optim.Optimizer]:
    """The model the loop calls (the DDP, or the compiled DDP) and its optimizer."""
    rank = dist.get_rank()
    group = _group(case, rank)
    torch.manual_seed(100 * group_index(case, rank))  # each data-parallel group has its own weights
    net = Net(**case.net_kwargs).to(device())
    if case.before_wrap is not None:
        case.before_wrap(net)
    for n in freeze_names:
        net.get_parameter(n).requires_grad_(False)
    wrapped = torch.compile(net, backend="eager") if case.compile == "inside" else net
    ddp = DDP(wrapped, device_ids=[device()] if device().type == "cuda" else None, process_group=group, **ddp_kwargs)
    if case.after_wrap is not None:
        case.after_wrap(net)
    model = torch.compile(ddp, backend="eager") if case.compile == "outside" else ddp
    return model, torch.optim.SGD(ddp.parameters(), lr=0.1)


def the_ddp(model: Any) -> DDP:
    """The DDP inside what the loop calls (a compiled DDP keeps it as `_orig_mod`)."""
    return model if isinstance(model, DDP) else model._orig_mod


def _micro_batches(case: Case, rank: int, step: int) -> list[Any]:
    return [batch(rank, step, m, same=case.same_batch) for m in range(case.micro_steps)]


def _loss_of(case: Case, rank: int) -> LossFn:
    return case.loss_by_group[group_index(case, rank)] if case.loss_by_group else case.loss


def make_scaler(case: Case, rank: int) -> Any:
    if case.scaler is None:
        return None
    return torch.amp.GradScaler(
        device().type, init_scale=2.0**10 if case.scaler == "rank-1-init" and rank == 1 else 2.0**16
    )


def train_step(case: Case, model: Any, inner: nn.Module, rank: int, step: int, scaler: Any = None) -> None:
    """One optimizer step's forward and backward passes, written the way users write them."""
    if case.evaluate is not None and rank == 0 and step == 1:
        x, _ = batch(rank, 100 + step)
        if case.evaluate == "grad":
            model(x).sum().item()
        else:
            with torch.no_grad():
                inner(x).sum().item()
    for micro, data in enumerate(_micro_batches(case, rank, step)):
        last = micro == case.micro_steps - 1
        if case.accumulate == "flag":
            model.require_backward_grad_sync = last  # nanoGPT's idiom
        context = model.no_sync() if case.accumulate == "no_sync" and not last else nullcontext()
        with context:
            loss = _loss_of(case, rank)(model, inner, data, step, rank) / case.micro_steps
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if case.log_metric is not None and last:
            metric = torch.ones(1, device=device())
            odd = case.log_metric == "max-on-rank-1" and rank == 1
            dist.all_reduce(metric, op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)
        # "The loss spiked: retry". Rank `retry_on_rank` retries in step 1 and the others in step 2, so the totals
        # match again and the run ends (a single unmatched retry would leave a rank waiting in its last all-reduce).
        retry_step = 1 if case.retry_on_rank == rank else 2
        if case.retry_on_rank is not None and step == retry_step and last:
            (case.loss(model, inner, data, step, rank) / case.micro_steps).backward()


def run_observed(case: Case, rank: int) -> dict[str, Any]:
    """The user's loop under observe(); returns the report as a dict plus what was raised."""
    ddp, opt = _build(case, case.ddp_kwargs, [])
    raised = None
    doctor = observe(the_ddp(ddp), optimizer=opt)
    scaler = make_scaler(case, rank)
    try:
        with doctor:
            for step in range(case.steps):
                train_step(case, ddp, ddp.module, rank, step, scaler)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
    except DDPFailure as exc:
        raised = exc.code
    report = doctor.report(timeout=20)
    assert_clean_reports_say_what_they_compared(report.to_dict(), str(report))
    return {"report": report.to_dict(), "raised": raised, "text": str(report)}


def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def run_applied(case: Case, rank: int, rec: dict[str, Any]) -> dict[str, Any]:
    """Apply the recommendation and check grads at every optimizer step against a reference average."""
    fixed = replace(case, **case.fixed)
    kwargs = {k: v for k, v in fixed.ddp_kwargs.items() if k == "broadcast_buffers"}
    kwargs.update(
        find_unused_parameters=rec["find_unused_parameters"],
        static_graph=rec["static_graph"],
        gradient_as_bucket_view=rec["gradient_as_bucket_view"],
    )
    model, opt = _build(fixed, kwargs, rec["freeze_before_wrap"])
    ddp = the_ddp(model)
    group = ddp.process_group
    trained = [p for p in ddp.module.parameters() if p.requires_grad]
    worst, unequal = 0.0, 0
    for step in range(case.steps):
        inner = getattr(ddp.module, "_orig_mod", ddp.module)  # the reference is the plain module
        reference = copy.deepcopy(inner)
        ref_params = [p for p in reference.parameters() if p.requires_grad]
        _reference_accumulate(fixed, reference, rank, step)
        # The harness's own collectives go through the CPU-capable path on any backend: all_reduce on the rank's
        # device, all_gather of the result back on the CPU for the comparison. Within the DDP's own group.
        expected = _flat_grads(ref_params)
        dist.all_reduce(expected, group=group)
        expected = expected.cpu() / dist.get_world_size(group)
        train_step(fixed, model, ddp.module, rank, step)
        got = _flat_grads(trained)
        everyone = [torch.empty_like(got) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, got, group=group)
        everyone, got = [e.cpu() for e in everyone], got.cpu()
        unequal += sum(not torch.equal(everyone[0], g) for g in everyone)
        worst = max(worst, float((got - expected).abs().max()))
        opt.step()
        opt.zero_grad()
    return {"max_abs_err": worst, "unequal_across_ranks": unequal}


def _reference_accumulate(case: Case, module: nn.Module, rank: int, step: int) -> None:
    for data in _micro_batches(case, rank, step):
        (_loss_of(case, rank)(module, module, data, step, rank) / case.micro_steps).backward()


GROUPS = [[0, 1], [2, 3]]
GROUP_CASES: dict[str, tuple[Case, list[set[str]]]] = {
    c.name: (c, codes)
    for c, codes in [
        # Two data-parallel groups of a 4-rank hybrid job, same architecture, different weights; group [2, 3] never
        # uses head_b. Each DDP is compared within its own group: no cross-group divergence, the head named for its
        # group only, with global ranks.
        (
            Case(
                name="subgroups-unused-head-in-one",
                groups=GROUPS,
                loss_by_group=[loss_both, loss_plain],
                ddp_kwargs={"find_unused_parameters": True},
                codes=set(),
            ),
            [{"find-unused-unneeded"}, {"unused-parameters"}],
        ),
        (Case(name="subgroups-all-used", groups=GROUPS, codes=set()), [set(), set()]),
    ]
}
"""4-rank cases over two data-parallel groups, with each group's expected codes."""


def run_case(rank: int, world: int, name: str) -> dict[str, Any]:
    """Rank function for the harness: observed run, then the applied recommendation."""
    case = CASES[name] if name in CASES else GROUP_CASES[name][0]
    out = run_observed(case, rank)
    out["applied"] = run_applied(case, rank, out["report"]["recommendation"])
    return out
