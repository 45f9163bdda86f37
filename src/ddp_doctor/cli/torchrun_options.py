"""A subcommand that takes torchrun's options (`check` and `bench`): ours first with the examples, then torchrun's
own, which parse exactly as torchrun parses them.

torchrun's parser lives in `torch.distributed.run`, and importing it imports torch (2-3 s). So that `--help`,
argument errors and the launch itself do not wait for that, the parser's options are kept in a small cache beside
the user's other caches (`~/.cache/ddp-doctor`, or `$XDG_CACHE_HOME`), keyed by torch's version and the files that
define them, and written the first time torch's own parser is built. The cache keeps each option's flags, type,
default, choices and help; torchrun's two environment-backed actions (`PET_<NAME>` defaults) are rebuilt as torch
writes them. A value whose type is a function of torch's (not `str`, `int` or `float`) stays a string here; the
launcher converts it with torch's own parser (`launch/torchrun.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["torchrun_actions", "torchrun_parser", "torchrun_subparser"]

_TYPES: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float}
_FORMAT = 1


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (imports torch)."""
    from torch.distributed.run import get_args_parser

    return get_args_parser()


class _Env(argparse._StoreAction):
    """torch's `env` action: the default comes from `PET_<DEST>` when that is set (torch/distributed/argparse_util)."""

    def __init__(self, option_strings: list[str], dest: str, default: Any = None, required: bool = False, **kw: Any):
        default = os.environ.get("PET_" + dest.upper(), default)
        super().__init__(option_strings, dest, default=default, required=required and not default, **kw)


class _NotPassedOn(argparse.Action):
    """A torchrun option whose action is torch's own code, not a value torchrun's launch reads: naming it is an
    argument error that says to run torchrun itself."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is torchrun's own command, not a launch option: run `torchrun {option_string}`")


# argparse's own actions, by the class name the cache records.
_PLAIN = {
    "_StoreConstAction": "store_const",
    "_AppendAction": "append",
    "_AppendConstAction": "append_const",
    "_CountAction": "count",
}


class _EnvFlag(argparse.Action):
    """torch's `check_env` action: a flag whose default is `PET_<DEST>` read as 0 or 1."""

    def __init__(self, option_strings: list[str], dest: str, default: bool = False, **kw: Any):
        kw.pop("nargs", None)
        kw.pop("const", None)
        default = bool(int(os.environ.get("PET_" + dest.upper(), "1" if default else "0")))
        super().__init__(option_strings, dest, const=True, default=default, nargs=0, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)


def _torch_files() -> tuple[str, list[Path]] | None:
    """torch's version and the files that define its launcher's options, found without importing torch."""
    try:
        version = importlib.metadata.version("torch")
        spec = importlib.util.find_spec("torch")
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "distributed"
    return version, [root / "run.py", root / "argparse_util.py"]


def _cache_path() -> Path | None:
    found = _torch_files()
    if found is None:
        return None
    version, files = found
    key = hashlib.sha256(f"{_FORMAT} {version}".encode())
    for path in files:
        try:
            st = path.stat()
        except OSError:
            return None
        key.update(f" {path} {st.st_size} {st.st_mtime_ns}".encode())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ddp-doctor" / f"torchrun-options-{key.hexdigest()[:16]}.json"


def _describe(action: argparse.Action, raw_defaults: dict[str, Any]) -> dict[str, Any]:
    kind = type(action).__name__
    type_name = getattr(action.type, "__name__", None) if action.type is not None else None
    return {
        "kind": {"env": "env", "check_env": "env_flag"}.get(kind, kind),
        "option_strings": list(action.option_strings),
        "dest": action.dest,
        "nargs": action.nargs,
        "const": action.const,
        "default": raw_defaults.get(action.dest, action.default),
        "type": type_name if type_name in _TYPES else ("str" if action.type is not None else None),
        "choices": list(action.choices) if action.choices is not None else None,
        "required": action.required,
        "help": action.help,
        "metavar": action.metavar,
    }


def _specs_from_torch() -> list[dict[str, Any]]:
    """Build torch's parser with no `PET_*` variable set (so the defaults are its own), and describe it."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PET_")}
    try:
        actions = [a for a in torchrun_parser()._actions if not isinstance(a, argparse._HelpAction)]
    finally:
        os.environ.update(saved)
    return [_describe(a, {}) for a in actions]


def _load_specs() -> list[dict[str, Any]]:
    path = _cache_path()
    if path is not None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    specs = _specs_from_torch()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(specs, tmp)
            os.replace(tmp.name, path)
        except OSError:
            pass  # no cache where none can be written: torch's parser is built each time
    return specs


def torchrun_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add torchrun's options to `parser` (from the cache when it is there) and return the actions added."""
    added = []
    for spec in _load_specs():
        kw: dict[str, Any] = {"dest": spec["dest"], "help": spec["help"]}
        if spec["metavar"] is not None:
            kw["metavar"] = spec["metavar"]
        kind = spec["kind"]
        if kind == "env_flag":
            kw["default"] = spec["default"]
            action = parser.add_argument(*spec["option_strings"], action=_EnvFlag, **kw)
        elif kind in ("env", "_StoreAction"):
            kw.update(default=spec["default"], required=spec["required"], nargs=spec["nargs"])
            if spec["type"] is not None:
                kw["type"] = _TYPES[spec["type"]]
            if spec["choices"] is not None:
                kw["choices"] = spec["choices"]
            if not spec["option_strings"]:
                kw.pop("dest")
                kw.pop("required")
                action = parser.add_argument(spec["dest"], **kw)
            else:
                action = parser.add_argument(*spec["option_strings"], action=_Env if kind == "env" else "store", **kw)
        elif kind in ("_StoreTrueAction", "_StoreFalseAction"):
            kw["default"] = spec["default"]
            store = "store_true" if kind == "_StoreTrueAction" else "store_false"
            action = parser.add_argument(*spec["option_strings"], action=store, **kw)
        elif kind in _PLAIN and spec["option_strings"]:
            kw["default"] = spec["default"]
            if kind in ("_StoreConstAction", "_AppendConstAction"):
                kw["const"] = spec["const"]
            action = parser.add_argument(*spec["option_strings"], action=_PLAIN[kind], **kw)
        else:
            # An option of torch's own making (torch 2.15's --print-completion prints a shell script and exits):
            # it keeps its default, and naming it says to run torchrun itself.
            kw.update(default=spec["default"], nargs=spec["nargs"])
            action = parser.add_argument(*spec["option_strings"], action=_NotPassedOn, **kw)
        added.append(action)
    return added


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Raw descriptions, without the indent argparse puts on their blank lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


def torchrun_subparser(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    description: str,
    epilog: str,
    examples: str,
    add_ours: Callable[[Any], None],
    with_torchrun: bool = True,
) -> argparse.ArgumentParser:
    """A subcommand that takes torchrun's options: ours first with the examples, then torchrun's in their own group.

    torchrun's own options go into a titled group, so that they parse exactly as torchrun parses them; only where
    `--help` shows them changes. `with_torchrun=False` leaves them out: the subcommand is then listed in the
    top-level help but cannot parse its own command line (the CLI adds them for the subcommand it runs).
    """
    p = sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(description, 100),
        epilog=epilog,
        add_help=False,
        usage=f"%(prog)s [{name} options] [torchrun options] SCRIPT [SCRIPT ARGS ...]",
        formatter_class=_Formatter,
    )
    ours = p.add_argument_group(f"{name} options")
    ours.add_argument("-h", "--help", action="help", help="show this help and exit")
    add_ours(ours)
    p.add_argument_group("examples", examples)
    p.set_defaults(_parser=p)
    if not with_torchrun:
        return p
    script = p.add_argument_group("the script")
    launcher = p.add_argument_group(
        "torchrun options", "PyTorch's launcher options, passed to torchrun unchanged (torchrun --help)"
    )
    scratch = argparse.ArgumentParser(add_help=False)
    for action in torchrun_actions(scratch):
        if action.dest == "training_script":
            action.metavar, action.help = "SCRIPT", "the training script (a module with -m), as torchrun takes it"
        elif action.dest == "training_script_args":
            action.metavar, action.help = "SCRIPT ARGS", "the script's own arguments"
        (launcher if action.option_strings else script)._add_action(action)
    return p
