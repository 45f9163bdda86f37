"""SIGINT, SIGTERM and SIGHUP as one exception, `Interrupted`, raised in the main thread of the `ddp-doctor`
process: the CLI installs the handlers before anything heavy is imported, and the supervisor stops the run's
processes when it catches it. Standard library only, so that installing it costs nothing."""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["Interrupted", "install_signal_handlers"]


class Interrupted(BaseException):
    """`ddp-doctor` received SIGINT, SIGTERM or SIGHUP. Raised in the main thread by the handlers below."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def install_signal_handlers() -> None:
    """Turn SIGINT, SIGTERM and SIGHUP into `Interrupted` (once: a second signal during clean-up is ignored)."""

    def handler(signum: int, _frame: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
