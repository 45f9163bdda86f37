"""The listener list every process-wide probe keeps (checkpoints, dataprobe, scalerprobe, collectives)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Listeners"]

T = TypeVar("T")


class Listeners(list[T], Generic[T]):
    """A list of listeners whose `add` returns the function that removes the one added (idempotent)."""

    def add(self, listener: T) -> Callable[[], None]:
        self.append(listener)

        def remove() -> None:
            if listener in self:
                self.remove(listener)

        return remove
