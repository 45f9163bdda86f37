"""The optimizer's settings as the doctor reads them at every step: a digest and words, never a device read."""

from __future__ import annotations

import torch

from ddp_doctor.observation.optimizers import describe


def test_settings_differ_by_value_and_a_device_tensor_is_never_read() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    a, b = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(params, lr=0.05)
    assert describe(a)[0] != describe(b)[0] and "lr=0.1" in describe(a)[1]
    # A tensor lr on a device whose value cannot be read without a copy (meta stands for a GPU here): no read.
    a.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")
    assert "lr=<tensor on meta>" in describe(a)[1]
