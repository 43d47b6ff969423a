"""offloaded-move-guard: three-way proof on real offloaded models (subprocesses), plus in-process
checks of the guard's call-through paths on plain modules offloaded with accelerate's own hooks."""

from __future__ import annotations

import copy
import sys

import pytest

import metapatch
from metapatch import MetapatchError
from metapatch._registry import Registry
from metapatch.diffs import apply_to_copy, diffs_for
from metapatch.patches.offloaded_move_guard import PATCH
from metapatch.selftest import run_scenario, scenarios_for

PATCH_ID = PATCH.id
SCENARIOS = scenarios_for(PATCH_ID)
AFFECTED, WHY, VERSIONS = metapatch.registry._gate(PATCH)


def test_scenarios_exist():
    names = {s.name for s in SCENARIOS}
    assert {"move-offloaded-submodule", "move-offloaded-peft-model", "moves-that-keep-working"} <= names


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_unpatched(scenario):
    outcome = run_scenario(scenario, patched=False)
    assert outcome.states[PATCH_ID] == "disabled"
    if AFFECTED and scenario.expected_error:
        assert not outcome.passed, f"{scenario.key} passed unpatched on an affected install ({WHY})"
        assert outcome.error_type == scenario.expected_error, outcome.traceback
        assert "Cannot copy out of meta tensor" in outcome.error
    else:
        assert outcome.passed, outcome.traceback or outcome.stderr_tail


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_patched(scenario):
    outcome = run_scenario(scenario, patched=True)
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["max_abs_diff"] == 0
    assert outcome.states[PATCH_ID] == ("applied" if AFFECTED else "not-affected")
    if AFFECTED and scenario.expected_error:
        # every path was refused by the guard itself, not by accelerate's top-level one
        assert set(outcome.metrics["moves"].values()) == {"OffloadedMoveError"}, outcome.metrics


@pytest.fixture(scope="module")
def accelerate_with_diff(tmp_path_factory):
    (diff,) = diffs_for(PATCH_ID)
    assert diff.header["Forwarded"] == "no" and diff.header["Last-Update"]
    return str(apply_to_copy(diff, tmp_path_factory.mktemp("accelerate-offloaded-move-guard")))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_upstream_diff_alone(scenario, accelerate_with_diff):
    outcome = run_scenario(scenario, patched=False, pythonpath=[accelerate_with_diff])
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["max_abs_diff"] == 0
    if scenario.expected_error:
        assert set(outcome.metrics["moves"].values()) == {"RuntimeError"}, outcome.metrics


def test_not_affected_without_accelerate():
    registry = Registry([PATCH])
    registry._versions["accelerate"] = None
    affected, reason, _ = registry._gate(PATCH)
    assert not affected and "accelerate is not installed" in reason


# -- in-process: the guard as installed in this test process ------------------------------------

torch = pytest.importorskip("torch")
hooks = pytest.importorskip("accelerate.hooks")
needs_guard = pytest.mark.skipif(not AFFECTED, reason=f"patch not active here: {WHY}")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.second = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.second(self.norm(self.first(x)))


def _offloaded_tiny():
    torch.manual_seed(0)
    model = Tiny().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    hooks.attach_align_device_hook(model.second, execution_device="cpu", offload=True)
    return model, x, expected


@needs_guard
def test_guard_installed_on_every_move_method():
    for method in ("to", "cuda", "cpu", "xpu", "ipu", "mtia"):
        current = vars(torch.nn.Module)[method]
        assert getattr(current, "_self_metapatch")[0] == PATCH_ID
        assert current.__wrapped__ is getattr(current, "_self_metapatch")[2]


@needs_guard
@pytest.mark.parametrize("move", [
    lambda m: m.to("cpu"),
    lambda m: m.cpu(),
    lambda m: torch.nn.Module.to(m, torch.device("cpu"), torch.float64),
    lambda m: m.second.to(device="cpu"),
    lambda m: m.to(torch.zeros(1)),
    lambda m: m.cuda(),
    lambda m: m.xpu(0),
], ids=["to", "cpu", "Module.to-device-dtype", "submodule-kwarg", "to-tensor", "cuda", "xpu"])
def test_refuses_before_touching_anything(move):
    model, x, expected = _offloaded_tiny()
    before = {n: t for n, t in model.state_dict(keep_vars=True).items()}
    with pytest.raises(MetapatchError) as info:
        move(model)
    assert isinstance(info.value, NotImplementedError)  # old `except NotImplementedError` still catches it
    text = str(info.value)
    assert ("second" in text or "the whole Linear" in text), text
    assert "device_map" in text and "inputs.to(model.device)" in text
    assert "first" not in text.split("offloaded to")[1].split(".")[0]  # names only what is offloaded
    after = model.state_dict(keep_vars=True)
    assert all(after[n] is t for n, t in before.items()), "a refused move converted some tensors"
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_calls_through_when_nothing_would_fail():
    model, x, expected = _offloaded_tiny()
    model.to(torch.float64)                    # dtype only: accelerate casts offloaded weights on load
    model.to(torch.float32)
    model.second.to("meta")                    # to meta needs no data
    plain = Tiny()
    assert plain.to("cpu") is plain and plain.cpu() is plain
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    # a dispatched but not offloaded model moves as before
    dispatched = Tiny()
    hooks.attach_align_device_hook(dispatched, execution_device="cpu", offload=False)
    assert dispatched.first.to("cpu") is dispatched.first


def test_weights_loaded_during_forward_are_not_refused():
    # Inside the forward pass the offload hook has filled the weights in: nothing is on meta then.
    model, x, _ = _offloaded_tiny()
    seen = []

    class MoveInside(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(module.to("cpu") is module)
            return args, kwargs

    hooks.add_hook_to_module(model.second, MoveInside(), append=True)
    with torch.no_grad():
        model(x)
    assert seen == [True]


@needs_guard
def test_deepcopy_and_sequential_hook():
    model, _, _ = _offloaded_tiny()
    hooks.add_hook_to_module(model.second, hooks.ModelHook(), append=True)
    assert isinstance(model.second._hf_hook, hooks.SequentialHook)
    clone = copy.deepcopy(model)
    for candidate in (model, clone):
        with pytest.raises(MetapatchError):
            candidate.cpu()


@needs_guard
def test_unpatch_restores_torch_and_raw_error_returns():
    originals = {m: getattr(vars(torch.nn.Module)[m], "_self_metapatch")[2] for m in ("to", "cpu")}
    metapatch.unpatch(PATCH_ID)
    try:
        assert all(vars(torch.nn.Module)[m] is o for m, o in originals.items())
        model, _, _ = _offloaded_tiny()
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor") as info:
            model.cpu()
        assert not isinstance(info.value, MetapatchError)
    finally:
        metapatch.install([PATCH_ID])
    assert {r["id"]: r["state"] for r in metapatch.status()}[PATCH_ID] == "applied"


def test_import_metapatch_does_not_import_torch():
    import subprocess

    code = "import sys, metapatch; print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
