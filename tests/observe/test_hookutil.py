"""hookutil: hooks that a copied or pickled model does not drag along, user-code call sites, tensors in outputs."""

from __future__ import annotations

import copy
import os
import pickle
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ddp_doctor.core.frames import format_site, user_site
from ddp_doctor.observation.hooks import Hook, tensors_in


class _Counter:
    def __init__(self) -> None:
        self.calls = 0

    def hook(self, _module: nn.Module, _args: object) -> None:
        self.calls += 1


def test_a_hook_calls_through_and_copies_and_pickles_as_a_no_op() -> None:
    counter = _Counter()
    model = nn.Linear(2, 2)
    model.register_forward_pre_hook(Hook(counter.hook))
    model(torch.ones(1, 2))
    assert counter.calls == 1
    twin = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    twin(torch.ones(1, 2))
    loaded(torch.ones(1, 2))
    assert counter.calls == 1  # the copies do not call back into the original's observer
    model(torch.ones(1, 2))
    assert counter.calls == 2


def test_user_site_is_the_callers_line() -> None:
    line = sys._getframe().f_lineno + 1
    site = user_site()
    assert site == f"{os.path.relpath(__file__)}:{line}"


def test_user_site_skips_the_methods_of_the_given_modules() -> None:
    class Model(nn.Module):
        def helper(self) -> str | None:
            return user_site({id(self)})

    site = Model().helper()  # HELPER-CALL
    assert site is not None and site.endswith(f":{_line_of_tag('HELPER-CALL')}")


def _line_of_tag(tag: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if f"# {tag}" in line)


def test_format_site_is_relative_inside_the_working_folder() -> None:
    assert format_site(os.path.join(os.getcwd(), "a", "b.py"), 7) == os.path.join("a", "b.py") + ":7"
    assert format_site("/elsewhere/c.py", 3) == "/elsewhere/c.py:3"


@dataclass
class _Output:
    loss: torch.Tensor
    extra: dict


def test_tensors_in_nested_outputs() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    found = list(tensors_in(_Output(loss=a, extra={"x": [b, (c, "text")], "n": 3})))
    assert [t is u for t, u in zip(found, (a, b, c))] == [True, True, True] and len(found) == 3
    deep: list = [a]
    for _ in range(12):
        deep = [deep]
    assert list(tensors_in(deep)) == []  # nesting deeper than 8 is not searched
