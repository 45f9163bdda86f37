"""The registry of the findings' words that report/ writes from the evidence (`ddp_doctor.report.words`), and
the readers of a finding's evidence the words share. Each family of codes registers its words in its own module
(`graph_words.py`, `sync_words.py`, `failure_words.py`, `checkpoint_words.py`)."""

from __future__ import annotations

from collections.abc import Callable

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding

__all__ = ["WORDS", "Words", "default_flags", "finds_unused", "flag", "measure", "value_of", "words"]

Words = Callable[[Finding], tuple[str, str]]
WORDS: dict[str, Words] = {}
"""The title and detail of each code whose words are the report's, from its finding's evidence."""


def words(code: Code) -> Callable[[Words], Words]:
    """Registers the words of `code`'s findings."""

    def register(fn: Words) -> Words:
        WORDS[str(code)] = fn
        return fn

    return register


def flag(f: Finding, name: str) -> bool:
    """A DDP flag the finding recorded (`labels`, ``"True"``/``"False"``)."""
    return f.labels.get(name) == "True"


def default_flags(f: Finding) -> bool:
    """Neither find_unused_parameters nor static_graph was set."""
    return not flag(f, "find_unused_parameters") and not flag(f, "static_graph")


def finds_unused(f: Finding) -> bool:
    """find_unused_parameters=True without static_graph: DDP marks what its forward does not reach unused."""
    return flag(f, "find_unused_parameters") and not flag(f, "static_graph")


def measure(f: Finding, name: str) -> float | None:
    """The value of the quantity `name` the finding measured, None where it did not."""
    return next((m.value for m in f.measured if m.name == name), None)


def value_of(f: Finding, name: str) -> float:
    """The quantity `name` that every builder of the finding's code measures (an error where one did not)."""
    value = measure(f, name)
    assert value is not None, f"{f.code} was built without its measured {name!r}"
    return value
