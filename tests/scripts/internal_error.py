"""A bug inside ddp-doctor, simulated: the diagnosis pipeline raises after the observed steps. `check` must say the
tool failed (exit 2, with the traceback), never print a clean report."""

from __future__ import annotations

from _train import setup, train

import ddp_doctor.doctor.doctor as doctor_module


def _broken(*_args: object, **_kwargs: object) -> None:
    raise AttributeError("simulated bug inside ddp-doctor")


doctor_module.diagnose = _broken

if __name__ == "__main__":
    train(setup())
