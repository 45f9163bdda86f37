"""The integrations' pure parts: optional imports, fixes phrased per framework and per installed version,
kwargs_handler, fail_on, argument checks. No process group needed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from checkrun import REPO

from ddp_doctor.analyze import snippets
from ddp_doctor.core.errors import InvalidArgumentError
from ddp_doctor.core.findings import Finding, Recommendation, Timing
from ddp_doctor.core.records import Flavor
from ddp_doctor.integrations._common import FindingsError, raise_if_failing
from ddp_doctor.observation.wrapstate import current_flavor
from ddp_doctor.report.model import Report

FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")
# TrainingArguments' ddp_* fields on transformers 4.57 (read from its wheel): no ddp_static_graph yet.
FLAVOR_4_57 = Flavor(
    transformers_version="4.57.6",
    training_arguments_fields=[
        "ddp_backend",
        "ddp_broadcast_buffers",
        "ddp_bucket_cap_mb",
        "ddp_find_unused_parameters",
        "ddp_timeout",
    ],
)


def report(*severities: str, rec: Recommendation | None = None) -> Report:
    codes = {"error": "unfrozen-after-wrap", "warning": "find-unused-unneeded", "info": "dynamic-graph"}
    findings = [Finding(code=codes[s], severity=s, title="t", detail="d") for s in severities]
    rec = rec or Recommendation(
        find_unused_parameters=False,
        static_graph=True,
        gradient_as_bucket_view=False,
        freeze_before_wrap=[],
        reason="r",
        verified=False,
    )
    return Report(
        tool_version="0",
        torch_version="0",
        backend="gloo",
        world_size=2,
        steps_observed=4,
        ddp_config={},
        findings=findings,
        recommendation=rec,
        timing=Timing(),
    )


def test_importing_ddp_doctor_imports_no_framework() -> None:
    code = (
        "import sys, ddp_doctor, ddp_doctor.cli, ddp_doctor.launch.session, ddp_doctor.integrations, "
        "ddp_doctor.analyze.snippets; ddp_doctor.observe; "
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_installed_training_arguments_has_every_ddp_field() -> None:
    import transformers
    import transformers.training_args

    flavor = current_flavor()
    fields = set(flavor.training_arguments_fields or ())
    expected = set(snippets.TRAINING_ARGUMENTS_FIELDS.values())
    if transformers.__version__.startswith("4."):
        expected.discard("ddp_static_graph")  # added in transformers 5; 4.x takes the route tested below
    assert expected <= fields
    if "ddp_static_graph" in fields:
        assert snippets.flags_fix("transformers", {"find_unused_parameters": False, "static_graph": True}, flavor) == (
            "set TrainingArguments(ddp_find_unused_parameters=False, ddp_static_graph=True)"
        )


def test_a_transformers_version_without_ddp_static_graph_gets_the_working_route() -> None:
    fix = snippets.flags_fix("transformers", {"static_graph": True, "find_unused_parameters": False}, FLAVOR_4_57)
    assert fix.startswith(
        "set TrainingArguments(ddp_find_unused_parameters=False) and set static_graph=True on "
        "the DDP kwargs the Trainer builds (TrainingArguments on transformers "
    ), fix
    assert "has no field for static_graph: subclass Trainer" in fix and "self.accelerator.ddp_handler" in fix
    rec = report().recommendation
    code = snippets.render_snippets(rec, {}, FLAVOR_4_57)["transformers"]
    assert "args = TrainingArguments(..., ddp_find_unused_parameters=False)" in code
    assert "ddp_static_graph" not in code
    assert "def _wrap_model(self, model, training=True, dataloader=None):" in code
    assert "handler.static_graph = True" in code
    compile(code.replace("...", "output_dir='x'"), "<snippet>", "exec")  # the route is valid Python


def test_fixes_in_each_framework_s_words() -> None:
    flags = {"find_unused_parameters": True}
    assert snippets.flags_fix("torch", flags) == "build DDP with find_unused_parameters=True"
    assert snippets.flags_fix("accelerate", flags) == (
        "pass Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])"
    )
    assert snippets.flags_fix("lightning", flags) == 'use Trainer(strategy="ddp_find_unused_parameters_true")'
    assert (
        snippets.flags_fix("lightning", {"static_graph": True})
        == "use Trainer(strategy=DDPStrategy(static_graph=True))"
    )
    for name in ("transformers", "accelerate", "lightning"):
        code = snippets.render_snippets(report().recommendation, {})[name]
        compile(code.replace("...", "output_dir='x'"), f"<{name}>", "exec")


def test_kwargs_handler_from_a_report_its_json_or_its_recommendation() -> None:
    from ddp_doctor.integrations.accelerate import kwargs_handler

    r = report()
    for source in (r, r.to_dict(), r.recommendation):
        handler = kwargs_handler(source)
        assert (handler.find_unused_parameters, handler.static_graph, handler.gradient_as_bucket_view) == (
            False,
            True,
            False,
        )
    assert kwargs_handler(r, bucket_cap_mb=50).bucket_cap_mb == 50
    with pytest.raises(InvalidArgumentError, match=r"\['bucket_size'\], which DistributedDataParallelKwargs"):
        kwargs_handler(r, bucket_size=50)
    with pytest.raises(InvalidArgumentError, match="without a 'recommendation' key"):
        kwargs_handler({"findings": []})
    with pytest.raises(InvalidArgumentError, match="got str"):
        kwargs_handler("report.json")
    # A report whose run failed before anything supported flags has null flags: nothing to apply, and it says why.
    unknown = report(rec=Recommendation.unknown("No DDP flags can be recommended: the ranks could not finish."))
    for source in (unknown, unknown.to_dict(), unknown.recommendation):
        with pytest.raises(InvalidArgumentError, match="recommends no DDP flags.*could not finish"):
            kwargs_handler(source)


def test_fail_on_thresholds() -> None:
    raise_if_failing(report("warning"), "error", where="x")
    raise_if_failing(report("error"), "never", where="x")
    raise_if_failing(report("info"), "warning", where="x")
    with pytest.raises(FindingsError, match=r"at or above fail_on='warning': find-unused-unneeded") as caught:
        raise_if_failing(report("warning", "info"), "warning", where="out/ddp_doctor.json")
    assert caught.value.code == "find-unused-unneeded" and "out/ddp_doctor.json" in str(caught.value)
    with pytest.raises(FindingsError) as caught:
        raise_if_failing(report("error", "warning"), "error", where="x")
    assert [f.code for f in caught.value.findings] == ["unfrozen-after-wrap"]


@pytest.mark.parametrize("module", ["transformers", "lightning"])
def test_callback_arguments_are_checked(module: str) -> None:
    import importlib

    callback = importlib.import_module(f"ddp_doctor.integrations.{module}").DoctorCallback
    with pytest.raises(InvalidArgumentError, match="steps must be a positive int .* got 0"):
        callback(steps=0)
    with pytest.raises(InvalidArgumentError, match="fail_on must be one of 'error', 'warning', 'never', got 'fatal'"):
        callback(fail_on="fatal")
    assert callback(steps=3).steps == 3


def test_lightning_callback_follows_pytorch_lightning_when_that_is_the_package_in_use() -> None:
    code = (
        "import sys, pytorch_lightning as pl; from ddp_doctor.integrations.lightning import DoctorCallback; "
        "print(issubclass(DoctorCallback, pl.Callback), 'lightning' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_the_fix_follows_the_installed_transformers() -> None:
    """Real install, no monkeypatch: transformers 5.x has ddp_static_graph; 4.x (run with `make test-transformers4`)
    does not, and then the fix must take the subclass route."""
    import transformers
    import transformers.training_args

    flavor = current_flavor()
    fields = flavor.training_arguments_fields
    assert fields is not None
    fix = snippets.flags_fix("transformers", {"find_unused_parameters": False, "static_graph": True}, flavor)
    if "ddp_static_graph" in fields:
        assert fix == "set TrainingArguments(ddp_find_unused_parameters=False, ddp_static_graph=True)", fix
    else:
        assert transformers.__version__.startswith("4."), transformers.__version__
        assert "has no field for static_graph: subclass Trainer" in fix and transformers.__version__ in fix, fix
