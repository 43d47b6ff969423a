"""The execution device of the selftest scenarios (metapatch.selftest._device) and the CUDA rules of the
harness: one decision per run's process, overridable by METAPATCH_SELFTEST_DEVICE; scenarios pinned to
the CPU run with CUDA hidden; no warm parent and no rank is forked from a process that touched CUDA.

The CUDA branches run on any machine: the decisions are functions of what they read, and
METAPATCH_SELFTEST_SIMULATE_CUDA makes a process report a CUDA build that sees a GPU ("present") or one
that initialised CUDA ("initialised"), which is all the fork and preload rules look at."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metapatch.selftest import Expect, Scenario, _device, run_scenario

REPO = Path(__file__).resolve().parents[1]
PROBE = "metapatch.selftest._device:probe"


# -- the decision -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, cuda_devices, device", [
    (None, 0, "cpu"), ("", 0, "cpu"), ("auto", 0, "cpu"),
    (None, 1, "cuda:0"), ("auto", 2, "cuda:0"),  # GPU 0, whatever the count
    ("cpu", 1, "cpu"), ("CPU", 0, "cpu"),  # forced onto the CPU on a GPU machine
    ("cuda", 1, "cuda:0"), ("cuda:1", 2, "cuda:1"),
])
def test_execution_device_choice(value, cuda_devices, device):
    assert _device.choose(_device.requested(value), cuda_devices) == device


def test_a_cuda_request_without_that_device_is_an_error_not_a_fallback():
    with pytest.raises(RuntimeError, match=r"METAPATCH_SELFTEST_DEVICE=cuda:0, but torch sees 0 CUDA device"):
        _device.choose("cuda:0", 0)
    with pytest.raises(RuntimeError, match="cuda:1, but torch sees 1"):
        _device.choose(_device.requested("cuda:1"), 1)
    with pytest.raises(ValueError, match="expected cpu, cuda, cuda:N or auto"):
        _device.requested("gpu")


def test_main_device_is_the_map_value_of_the_execution_device(monkeypatch):
    monkeypatch.setattr(_device, "_decided", "cuda:0")
    assert (_device.main_device(), _device.on_gpu()) == (0, True)
    monkeypatch.setattr(_device, "_decided", "cpu")
    assert (_device.main_device(), _device.on_gpu(), _device.gpu_count()) == ("cpu", False, 0)


def test_pinned_environment_hides_cuda_before_torch_looks():
    env = _device.pin_environment("two ranks over gloo")
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    assert env[_device.DEVICE_ENV] == "cpu" and env[_device.PIN_ENV] == "two ranks over gloo"
    assert _device.cuda_hidden(env) and _device.cuda_hidden({"CUDA_VISIBLE_DEVICES": "-1"})
    assert not _device.cuda_hidden({}) and not _device.cuda_hidden({"CUDA_VISIBLE_DEVICES": "0"})
    # What torch itself makes of that environment, in a fresh interpreter: no device, the driver untouched.
    code = ("import torch, json; from metapatch.selftest import _device; "
            "print(json.dumps([torch.cuda.is_available(), torch.cuda.device_count(), _device.cuda_touched()]))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == [False, 0, ""]


# -- fork rules -------------------------------------------------------------------------------------

def test_cuda_touched_reads_the_driver_and_the_simulation(monkeypatch):
    monkeypatch.delenv(_device.SIMULATE_ENV, raising=False)
    maps = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
    if not _device.cuda_built():  # a CPU build of torch: nothing a fork could break, whatever is mapped
        assert _device.cuda_touched(maps) == ""
    monkeypatch.setenv(_device.SIMULATE_ENV, "present")  # a CUDA build that sees a GPU, nothing initialised
    assert _device.cuda_built() and _device.cuda_touched("") == ""
    monkeypatch.setenv(_device.SIMULATE_ENV, "initialised")
    assert "initialised" in _device.cuda_touched("")


def test_cuda_touched_on_a_cuda_build_checks_init_and_driver(monkeypatch):
    """The branch a CUDA build takes, with torch's answers stubbed: the driver library in the process's
    maps is enough to refuse (torch.cuda.is_available() loads it without torch's lazy init)."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv(_device.SIMULATE_ENV, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    clean = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcudart.so.13\n"  # the runtime alone initialises nothing
    assert _device.cuda_touched(clean) == ""
    assert "driver is loaded" in _device.cuda_touched(clean + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/libcuda.so.1\n")
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert "forked from one that initialised CUDA" in _device.cuda_touched(clean)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "torch initialised CUDA" in _device.cuda_touched(clean)


def test_preload_leaves_out_what_initialises_cuda_where_a_gpu_may_be_seen(monkeypatch):
    wanted = ["transformers", "accelerate", "peft", "bitsandbytes"]
    monkeypatch.setenv(_device.SIMULATE_ENV, "present")
    kept, skipped = _device.preload_plan(wanted, environ={})
    assert kept == ["transformers", "accelerate", "peft"] and list(skipped) == ["bitsandbytes"]
    assert "initialises CUDA at import" in skipped["bitsandbytes"]
    # CUDA hidden from the parent: nothing to initialise, the whole stack is preloaded.
    assert _device.preload_plan(wanted, environ={"CUDA_VISIBLE_DEVICES": ""}) == (wanted, {})
    monkeypatch.delenv(_device.SIMULATE_ENV)
    if not _device.cuda_built():
        assert _device.preload_plan(wanted, environ={}) == (wanted, {})


def _zygote_hello(env: dict) -> dict:
    """The first line a warm parent writes (then it exits: its input is closed)."""
    zygote = REPO / "metapatch" / "selftest" / "_zygote.py"
    full = dict(os.environ, METAPATCH_ZYGOTE_REPO=str(REPO), OMP_NUM_THREADS="1", **env)
    done = subprocess.run([sys.executable, str(zygote)], env=full, input="", capture_output=True, text=True,
                          timeout=300)
    return json.loads(done.stdout.splitlines()[0])


def test_warm_parent_leaves_bitsandbytes_out_where_a_gpu_may_be_seen():
    pytest.importorskip("bitsandbytes")
    hello = _zygote_hello({_device.SIMULATE_ENV: "present", "METAPATCH_ZYGOTE_PRELOAD": "json,bitsandbytes"})
    assert hello["ready"] is True
    assert hello["preloaded"] == ["json"] and list(hello["skipped"]) == ["bitsandbytes"]


def test_warm_parent_refuses_to_start_once_cuda_is_touched():
    hello = _zygote_hello({_device.SIMULATE_ENV: "initialised", "METAPATCH_ZYGOTE_PRELOAD": "json"})
    assert hello["ready"] is False and "CUDA is not untouched after importing torch" in hello["error"]
    torch_only = _zygote_hello({_device.SIMULATE_ENV: "initialised"})
    assert torch_only["ready"] is False


def test_runs_start_fresh_interpreters_where_every_warm_parent_refuses(tmp_path):
    """A harness whose parents would touch CUDA: each run is a fresh interpreter, and still passes."""
    code = ("import json; from metapatch.selftest import Scenario, run_scenario; "
            f"o = run_scenario(Scenario('p', 'probe', {PROBE!r}), patched=True); "
            "print(json.dumps([o.passed, o.metrics, o.device]))")
    env = dict(os.environ, **{_device.SIMULATE_ENV: "initialised"})
    env.pop(_device.DEVICE_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True,
                         text=True, check=True, timeout=300)
    passed, metrics, device = json.loads(out.stdout.splitlines()[-1])
    assert passed and metrics["started_as"] == "_child.py", metrics  # not a fork of _zygote.py
    assert device == metrics["device"]


# -- the runs ---------------------------------------------------------------------------------------
# Through the warm parent that serves runs with an environment of their own (torch only: quick to start);
# the preloaded parents fork children the same way (tests/test_selftest_speed.py).
AS_GIVEN = {_device.DEVICE_ENV: os.environ.get(_device.DEVICE_ENV) or "auto"}


def test_a_pinned_scenario_runs_with_cuda_hidden_and_says_why():
    pinned = Scenario("p", "probe-pinned", PROBE, device="cpu", device_reason="two ranks over gloo")
    outcome = run_scenario(pinned, patched=True, env=AS_GIVEN)
    assert outcome.passed, outcome.traceback
    assert (outcome.device, outcome.device_note) == ("cpu", "two ranks over gloo")
    metrics = outcome.metrics
    assert metrics["device"] == "cpu" and metrics["pinned"] == "two ranks over gloo"
    assert metrics["cuda_visible_devices"] == "" and metrics["nvml_check"] == "1"
    assert metrics["cuda_touched"] == ""  # deciding "cpu" asked CUDA nothing: its ranks may fork
    assert metrics["started_as"] == "_zygote.py"  # a fork of the warm parent, as every plain run


def test_an_unpinned_scenario_computes_on_the_execution_device():
    outcome = run_scenario(Scenario("p", "probe", PROBE), patched=False, env=AS_GIVEN)
    assert outcome.passed, outcome.traceback
    expected = _device.choose(_device.requested(os.environ.get(_device.DEVICE_ENV)),
                              _device.visible_cuda_devices())
    assert outcome.device == outcome.metrics["device"] == expected
    assert outcome.device_note is None and outcome.metrics["pinned"] == ""
    assert outcome.metrics["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_forcing_the_device_reaches_the_run():
    outcome = run_scenario(Scenario("p", "probe", PROBE), patched=True, env={_device.DEVICE_ENV: "cpu"})
    assert outcome.passed and outcome.device == "cpu" and outcome.metrics["cuda_touched"] == ""


def test_a_pinned_scenario_must_say_why():
    with pytest.raises(ValueError, match="says why"):
        Scenario("p", "s", PROBE, device="cpu")
    with pytest.raises(ValueError, match="device must be"):
        Scenario("p", "s", PROBE, device="cuda:0")


# -- expectations and tolerances per device ----------------------------------------------------------

def test_expectations_measured_on_the_cpu_carry_over_to_a_gpu_without_the_text():
    scenario = Scenario("p", "s", PROBE, expected_error="AssertionError", expected_message="logits differ",
                        unpatched=(Expect("KeyError", "lm_head", when={"metapatch": "<0"}),))
    cpu = scenario.expected_unpatched(True, device="cpu")
    assert (cpu.error, cpu.message) == ("AssertionError", "logits differ")
    gpu = scenario.expected_unpatched(True, device="cuda:0")
    # A meta operand: garbage on the CPU, refused by a GPU kernel.
    assert (gpu.error, gpu.message) == ("AssertionError|RuntimeError", "")
    assert scenario.expected_unpatched(False, device="cuda:0").error == ""  # not affected: passes anywhere
    measured = Scenario("p", "s", PROBE, expected_error="AssertionError",
                        unpatched=(Expect("ValueError", "x", devices=("cuda",)),))
    assert measured.expected_unpatched(True, device="cuda:0") == Expect("ValueError", "x", devices=("cuda",))
    assert measured.expected_unpatched(True, device="cpu").error == "AssertionError"


def test_gpu_tolerance_applies_where_the_run_computed_on_a_gpu():
    scenario = Scenario("p", "s", PROBE, tolerance=0.0, gpu_tolerance=1e-6, tolerance_reason="atomics")
    assert scenario.tolerance_on("cpu") == 0.0 and scenario.tolerance_on(None) == 0.0
    assert scenario.tolerance_on("cuda:0") == 1e-6
    assert Scenario("p", "s", PROBE, tolerance=1e-5).tolerance_on("cuda:0") == 1e-5


def test_every_pinned_scenario_is_pinned_for_a_reason_and_rank_scenarios_are_pinned():
    from metapatch.selftest import all_scenarios

    for scenario in all_scenarios():
        module = __import__(scenario.function.partition(":")[0], fromlist=["_"])
        source = Path(module.__file__).read_text()
        if "run_ranks(" in source and scenario.function.partition(":")[2] in _functions_calling(source, "run_ranks("):
            assert scenario.device == "cpu", f"{scenario.key} runs ranks over gloo: pin it to the CPU"
        if scenario.device:
            assert scenario.device_reason, scenario.key


def _functions_calling(source: str, call: str) -> set:
    """Top-level functions of ``source`` whose body contains ``call``."""
    import ast

    tree = ast.parse(source)
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and call in ast.unparse(node)}
