"""What the script raised on a rank, as the rank file records it (`core.rankfiles.RaisedError`): the error, the
user's line, the step, and DDP's own error explained with parameter names by the doctor of the model that raised."""

from __future__ import annotations

import traceback

from ddp_doctor.analyze import explain_shape_error
from ddp_doctor.core.frames import user_frame
from ddp_doctor.core.rankfiles import ExplainedError, RaisedError
from ddp_doctor.doctor import Doctor
from ddp_doctor.observation.crash import raising_ddp

__all__ = ["PEER_LOST", "raised_error"]

PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "Application timeout caused pair closure",  # gloo, on the rank whose peer timed out first
    "communicator was aborted",
    "remote process exited",
    "NCCL error",
)
"""What a collective raises on the ranks that survive when a peer dies or stops (gloo, then NCCL wording)."""


def raised_error(exc: BaseException, doctors: list[Doctor], *, phase: str) -> RaisedError:
    """The record of `exc`, explained by the doctors (when it is DDP's own error); `phase`: where the rank was."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    explained = None
    step = -1
    # DDP's own errors are raised inside the forward of the model that failed: only that model's doctor
    # records the crash (a GAN's critic failing says nothing about its generator).
    raising = raising_ddp(exc)
    for doctor in doctors:
        if raising is not None and doctor.ddp is not raising:
            continue
        failure = doctor.explain(exc, hint="")
        step = max(step, doctor.record().crash_step)
        if failure is not None and explained is None:
            numel = dict(zip(doctor.info.param_names, doctor.info.numels))
            explained = ExplainedError(
                code=failure.code,
                params=list(failure.params),
                message=str(failure),
                numels=[numel.get(n, 0) for n in failure.params],
            )
    message = str(exc)
    if explained is None:
        explained = explain_shape_error(message)  # DDP's constructor refused shapes that differ by rank
    return RaisedError(
        type=type(exc).__name__,
        message=message[:4000],
        traceback="".join(tb)[-20000:],
        site=user_frame(traceback.extract_tb(exc.__traceback__)),
        step=step,
        explained=explained,
        peer_lost=explained is None and any(p in message for p in PEER_LOST),
        phase=str(phase),
    )
