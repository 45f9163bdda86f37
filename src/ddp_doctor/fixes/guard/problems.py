"""How the guard reports a problem: recorded on `Guard.problems`, logged once, or raised."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ddp_doctor.core.errors import GuardError
from ddp_doctor.core.findings import Finding

__all__ = ["LOGGER_NAME", "Reporter", "render"]

LOGGER_NAME = "ddp_doctor.guard"
"""Every part of the guard logs here (the name the README documents), whichever private module it lives in."""

logger = logging.getLogger(LOGGER_NAME)


class Reporter:
    """Records, logs or raises the guard's findings, and remembers what it already said.

    A problem is reported under a key (``("flip", frozen, unfrozen)``, ``("wrapper-bypass", site)``, ...): a key
    already reported is not logged again, since a diverged run would otherwise log every `every` steps.
    """

    def __init__(self, *, on_problem: str, group: dist.ProcessGroup | None) -> None:
        self.on_problem = on_problem
        self.found: list[Finding] = []
        self.broken = False
        """True after an internal error: the local detectors stop; the next comparison turns every rank off."""
        self._group = group
        self._rank = dist.get_rank()
        self._keys: set[tuple[Any, ...]] = set()

    def seen(self, key: tuple[Any, ...]) -> bool:
        return key in self._keys

    def seen_kind(self, kind: str) -> bool:
        return any(k[0] == kind for k in self._keys)

    def forget(self, kind: str) -> None:
        """Report problems of `kind` again when they come back (after the replicas agree again, after refreeze)."""
        self._keys = {k for k in self._keys if k[0] != kind}

    def report(
        self,
        findings: list[Finding],
        *,
        key: tuple[Any, ...] | None = None,
        collective: bool = False,
        explicit: bool = False,
        save: bool = False,
    ) -> None:
        """Record, raise or log `findings`. An explicit check (`check_now`, `before_save`) always reports; the
        result of a collective comparison is identical on every rank, so only the group's first rank logs it."""
        if not findings:
            return
        repeat = key is not None and key in self._keys and not explicit
        if not repeat:
            if key is not None:
                self._keys.add(key)
            self.found.extend(findings)
        errors = [f for f in findings if f.severity == "error"]
        if self.on_problem == "raise" and errors:
            raise GuardError("\n".join(render(f) for f in errors), findings=errors)
        if repeat or (collective and dist.get_rank(self._group) != 0):
            return
        for f in findings:
            level = logging.ERROR if save and f.severity == "error" else logging.WARNING
            logger.log(level, "%s", render(f))

    def fail(self, exc: BaseException) -> None:
        """An internal error: log once, stop the local detectors; the next comparison turns every rank off."""
        if self.broken:
            return
        self.broken = True
        logger.warning(
            "ddp-doctor guard (rank %d) hit an internal error and turns itself off; training continues "
            "unguarded: %s: %s",
            self._rank,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )


def render(f: Finding) -> str:
    """The log text of one finding (and of a `GuardError`)."""
    params = ", ".join(str(p) for p in f.params[:6]) + (f" and {len(f.params) - 6} more" if len(f.params) > 6 else "")
    lines = [f"ddp-doctor guard [{f.code}] {f.title}"]
    if params and not all(f"  {p.name} (" in f.detail for p in f.params):  # the detail lists them otherwise
        lines.append(f"  params: {params}")
    lines.append(f"  ranks: {f.ranks}; step: {f.steps}")
    lines.append("  " + f.detail.replace("\n", "\n  "))
    lines.append(f"  fix: {f.fix}")
    return "\n".join(lines)
