"""offloaded-move-guard: three-way proof on real offloaded models (subprocesses), plus in-process
checks of the guard's call-through paths on plain modules offloaded with accelerate's own hooks."""

from __future__ import annotations

import copy
import sys

import pytest

import metapatch
from metapatch import MetapatchError
from metapatch._framework.registry import Registry
from metapatch.patches.offloaded_move_guard import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

PATCH_ID = PATCH.id
AFFECTED, WHY, VERSIONS, _ = metapatch.registry.gate(PATCH)


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH_ID,)

    def test_scenarios_exist(self):
        super().test_scenarios_exist()
        names = {s.name for s in self.scenarios()}
        assert {"move-offloaded-submodule", "move-offloaded-peft-model", "moves-that-keep-working"} <= names

    def check_patched(self, scenario, outcome):
        if AFFECTED and scenario.expected_error:
            # every path was refused by the guard itself, not by accelerate's top-level one
            assert set(outcome.metrics["moves"].values()) == {"OffloadedMoveError"}, outcome.metrics

    def check_diff(self, scenario, outcome):
        if scenario.expected_error:
            assert set(outcome.metrics["moves"].values()) == {"RuntimeError"}, outcome.metrics


def test_not_affected_without_accelerate():
    registry = Registry([PATCH])
    registry._versions["accelerate"] = None
    affected, reason, _, _ = registry.gate(PATCH)
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


# -- the pass-through path: no walk over the module tree until an offload hook exists -----------

# Counts the guard's walks over a moved tree (``walks``), in a probe subprocess.
COUNT_WALKS = r"""
import metapatch.patches.offloaded_move_guard as guard
walks = []
original_walk = guard._named_modules
def counting_walk(root):
    walks.append(type(root).__name__)
    return original_walk(root)
guard._named_modules = counting_walk
"""

FLAG_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
order = sys.argv[2]
if order == "accelerate-first":
    import accelerate.hooks
import metapatch
import torch
import accelerate.hooks as hooks
from metapatch.patches.offloaded_move_guard import _OffloadSeen

""" + COUNT_WALKS + r"""
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
result = {"state": {r["id"]: r["state"] for r in metapatch.status()}["offloaded-move-guard"],
          "seen_at_start": _OffloadSeen.seen}
model.to("cpu"); model.cpu(); model[1].to(torch.device("cpu"))
result["walks_before_any_offload"] = len(walks)
hooks.attach_align_device_hook(model[0], execution_device="cpu", offload=False)
model.to("cpu")
result["seen_after_non_offload_hook"] = _OffloadSeen.seen
hooks.attach_align_device_hook(model[1], execution_device="cpu", offload=True)
result["seen_after_offload_hook"] = _OffloadSeen.seen
try:
    model.to("cpu")
    result["refused"] = None
except Exception as exc:
    result["refused"] = type(exc).__name__
print(json.dumps(result))
"""


def _flag_probe(order):
    import json
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", FLAG_PROBE, root, order], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_guard
def test_pass_through_does_not_walk_until_an_offload_hook_is_attached():
    result = _flag_probe("metapatch-first")
    assert result["state"] == "applied"
    assert result["seen_at_start"] is False
    assert result["walks_before_any_offload"] == 0
    assert result["seen_after_non_offload_hook"] is False  # a hook that does not offload moves nothing to meta
    assert result["seen_after_offload_hook"] is True
    assert result["refused"] == "OffloadedMoveError"


@needs_guard
def test_late_import_checks_every_move():
    # accelerate imported before metapatch: hooks may have been attached unseen, so the guard
    # walks from the start (as it did before the flag) and still refuses.
    result = _flag_probe("accelerate-first")
    assert result["state"] == "applied"
    assert result["seen_at_start"] is True
    assert result["walks_before_any_offload"] > 0
    assert result["refused"] == "OffloadedMoveError"


# -- after an offload: which modules are hooked is cached per root until a hook or a submodule
#    is added anywhere; whether they still offload is read live on each move

CACHE_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import metapatch
import torch
import accelerate.hooks as hooks
from metapatch.patches.offloaded_move_guard import OffloadedMoveError

def offloaded_linear():
    layer = torch.nn.Linear(4, 4)
    hooks.attach_align_device_hook(layer, execution_device="cpu", offload=True)
    return layer

def outcome(move):
    try:
        move()
        return "moved"
    except OffloadedMoveError:
        return "OffloadedMoveError"
    except NotImplementedError as exc:
        return "NotImplementedError: " + str(exc)[:60]

elsewhere = offloaded_linear()  # an offload somewhere in the process turns the guard's walks on
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
other = torch.nn.Sequential(torch.nn.Linear(4, 4))
""" + COUNT_WALKS + r"""
result = {}
for _ in range(3):
    model.to("cpu"); model.cpu(); model.to(torch.float32)
result["walks_for_nine_moves"] = len(walks)
hooks.attach_align_device_hook(model[1][0], execution_device="cpu", offload=True)
result["after_a_hook_inside"] = outcome(lambda: model.to("cpu"))
hooks.remove_hook_from_module(model[1][0])
result["after_removing_it"] = outcome(lambda: model.to("cpu"))
other.to("cpu")
other.extra = offloaded_linear()
result["after_setattr_of_an_offloaded_child"] = outcome(lambda: other.to("cpu"))
third = torch.nn.Sequential(torch.nn.Linear(4, 4))
third.to("cpu")
third._modules["hidden"] = offloaded_linear()  # behind torch's back, but a hook was attached since
result["after_a_direct_modules_assignment"] = outcome(lambda: third.to("cpu"))
fourth = torch.nn.Sequential(torch.nn.Linear(4, 4))
hidden = offloaded_linear()
fourth.to("cpu")
fourth._modules["hidden"] = hidden  # behind torch's back, nothing attached since: the known limit
result["after_an_unseen_change"] = outcome(lambda: fourth.to("cpu"))
print(json.dumps(result))
"""


@needs_guard
def test_moves_after_an_offload_use_the_cache_and_see_every_hook_change():
    import json
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", CACHE_PROBE, root], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["walks_for_nine_moves"] == 1
    assert result["after_a_hook_inside"] == "OffloadedMoveError"
    assert result["after_removing_it"] == "moved"
    assert result["after_setattr_of_an_offloaded_child"] == "OffloadedMoveError"
    assert result["after_a_direct_modules_assignment"] == "OffloadedMoveError"
    # Missed by the cache, but never moved silently: torch's own error, as without metapatch.
    assert result["after_an_unseen_change"].startswith("NotImplementedError: Cannot copy out of meta tensor")


@needs_guard
def test_an_unhashable_module_still_moves_and_is_still_guarded():
    import dataclasses

    @dataclasses.dataclass(eq=True)  # defines __eq__, so __hash__ is None: no weak-keyed cache entry
    class Holder(torch.nn.Module):
        width: int = 4

        def __post_init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(self.width, self.width)

    hooks.attach_align_device_hook(torch.nn.Linear(2, 2), execution_device="cpu", offload=True)
    holder = Holder()
    with pytest.raises(TypeError):
        hash(holder)
    assert holder.to("cpu") is holder and holder.to(torch.float64) is holder
    hooks.attach_align_device_hook(holder.inner, execution_device="cpu", offload=True)
    with pytest.raises(MetapatchError):
        holder.to("cpu")
