"""`metapatch selftest` and `metapatch doctor`, run as users run them (a subprocess), plus the
verdict logic on constructed outcomes. Only offloaded-move-guard's own scenarios are used, so these
tests do not depend on which other patches ship."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import metapatch
from metapatch.commands import doctor, selftest
from metapatch.patches.offloaded_move_guard import PATCH
from metapatch.selftest import Scenario, all_scenarios, run_scenario, scenarios_for

ROOT = Path(__file__).resolve().parents[1]
AFFECTED = metapatch.registry.gate(PATCH).affected


def _cli(*args, cwd=None, timeout=600, env=None):
    env_path = str(ROOT)
    import os

    extra = env or {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [env_path, os.environ.get("PYTHONPATH")])))
    env.pop("METAPATCH_DISABLE", None)
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "metapatch", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


# -- selftest -------------------------------------------------------------------------------------


def test_selftest_json_on_the_failing_scenario():
    proc = _cli("selftest", "--json", "--scenario", "offloaded-move-guard/move-offloaded-submodule")
    data = json.loads(proc.stdout)
    (row,) = data["rows"]
    assert row["scenario"] == "offloaded-move-guard/move-offloaded-submodule"
    assert row["affected"] is AFFECTED
    assert row["installed"]["accelerate"] == metapatch.registry._version("accelerate")
    assert row["patched"]["passed"] and row["patched"]["max_abs_diff"] == 0
    assert row["patched"]["patch_state"] == ("applied" if AFFECTED else "not-affected")
    assert row["unpatched"]["patch_state"] == "disabled"
    if AFFECTED:
        assert row["unpatched"]["error_type"] == "NotImplementedError" and row["verdict"] == "fixed"
    # the two runs go out together: the row's time covers the longer one
    assert row["seconds"] >= max(row["unpatched"]["seconds"], row["patched"]["seconds"]) - 0.01 > 0
    assert row["cpu_seconds"] == pytest.approx(row["unpatched"]["cpu_seconds"] + row["patched"]["cpu_seconds"], abs=0.02)
    assert proc.returncode == data["exit_code"] == 0, proc.stderr[-3000:]


def test_selftest_table_names_every_column():
    proc = _cli("selftest", "--scenario", "moves-that-keep-working")
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["SCENARIO", "AFFECTED", "UNPATCHED", "PATCHED", "DEVICE", "SECONDS", "VERDICT"]
    row = next(line for line in lines if line.startswith("offloaded-move-guard/moves-that-keep-working"))
    assert "passes" in row and "pass, max diff 0" in row and ("yes" in row or "no" in row)
    from metapatch.selftest import _device

    device, seconds = row.split("]")[-1].split()[:2]
    assert device == _device.choose(_device.requested(os.environ.get(_device.DEVICE_ENV)), _device.visible_cuda_devices())
    assert float(seconds) > 0
    assert lines[-1].startswith("1 scenarios in") and "fixes every affected scenario" in lines[-1]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


def test_selftest_unknown_selection_is_an_error():
    proc = _cli("selftest", "--patch", "no-such-patch")
    assert proc.returncode == 2 and "unknown patch id(s) no-such-patch" in proc.stderr
    proc = _cli("selftest", "--patch", "offloaded-move-gard")
    assert proc.returncode == 2 and "did you mean" in proc.stderr and "offloaded-move-guard" in proc.stderr
    proc = _cli("selftest", "--scenario", "no-such-scenario")
    assert proc.returncode == 2 and "no scenario matches --scenario no-such-scenario" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (("--jobs", "0"), "--jobs 0: give at least 1"),
    (("--timeout", "0"), "--timeout 0: give a positive number"),
])
def test_selftest_rejects_bad_numbers(args, message):
    proc = _cli("selftest", *args)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_timeout_is_reported_as_a_timeout_not_as_a_failure_to_fix():
    row = selftest.Row("p/s", "p", "", True, "gate", expected_error="KeyError")
    row.unpatched = {"passed": False, "error_type": "TimeoutExpired", "error": "no result after 5.0 s"}
    row.patched = {"passed": True, "error_type": None}
    row = selftest.judge(row)
    assert (row.verdict, row.ok) == ("TIMED OUT (no result after 5.0 s)", False)
    line = selftest.summary_line([row], 6)
    assert "timed out (no result, so no verdict): p/s" in line and "NOT fixed" not in line and "1 timed out" in line
    assert selftest.exit_code([row]) == 1


def test_nothing_ran_is_said_and_exits_1():
    rows = [selftest.Row("p/s", "p", "", False, "transformers is not installed", {"transformers": None},
                         verdict="skipped"),
            selftest.Row("q/s", "q", "", None, "", not_applicable="needs x", verdict="n/a (needs x)")]
    assert selftest.nothing_ran(rows) and selftest.exit_code(rows) == 1
    line = selftest.summary_line(rows, 0)
    assert "NOTHING RAN" in line and "not installed: transformers" in line and "fixes every" not in line
    ran = rows + [selftest.judge(_row(True, "E", False, True))]
    assert not selftest.nothing_ran(ran) and selftest.exit_code(ran) == 0


def test_every_patch_has_a_scenario_of_its_own_and_one_without_is_named():
    assert selftest.without_scenarios(metapatch.registry, all_scenarios()) == []

    class Registry:
        patches = {"has-one": None, "has-none": None}

    assert selftest.without_scenarios(Registry(), [Scenario("has-one", "s", "m:f")]) == ["has-none"]


def test_selection_by_patch_and_slow_flag():
    scenarios = all_scenarios()
    mine = selftest.select(scenarios, [PATCH.id], [], include_slow=False)
    assert mine and {s.patch_id for s in mine} == {PATCH.id}
    assert [s.key for s in mine] == [s.key for s in scenarios_for(PATCH.id) if s.in_selftest]
    everything = selftest.select(scenarios, [], [], include_slow=True)
    assert len(everything) == len(scenarios)
    assert all(s.in_selftest for s in selftest.select(scenarios, [], [], include_slow=False))


def _row(affected, expected, unpatched_passed, patched_passed):
    row = selftest.Row("p/s", "p", "", affected, "gate", expected_error=expected)
    row.unpatched = {"passed": unpatched_passed, "error_type": None if unpatched_passed else "NotImplementedError"}
    row.patched = {"passed": patched_passed, "error_type": None if patched_passed else "AssertionError",
                   "error": "x", "traceback_tail": "", "max_abs_diff": 0.0}
    return selftest.judge(row)


@pytest.mark.parametrize("affected, expected, unpatched, patched, verdict, ok", [
    (True, "NotImplementedError", False, True, "fixed", True),
    (True, "NotImplementedError", True, True, "not reproduced", True),
    (True, "NotImplementedError", False, False, "FAILED", False),
    (False, "NotImplementedError", True, True, "passes", True),      # unaffected install, bug absent: fine
    (False, "NotImplementedError", False, True, "BUG OUTSIDE GATE", False),
    (False, "NotImplementedError", False, False, "FAILED", False),
    (True, "", True, True, "passes", True),                           # a regression guard
    (True, "", True, False, "FAILED", False),
])
def test_verdicts_and_exit_code(affected, expected, unpatched, patched, verdict, ok):
    row = _row(affected, expected, unpatched, patched)
    assert (row.verdict, row.ok) == (verdict, ok)
    assert selftest.exit_code([_row(True, "E", False, True), row]) == (0 if ok else 1)


def test_a_declared_upstream_pass_is_no_missing_reproduction():
    """Where the scenario declares that upstream passes on the installed releases (an ``Expect("")``), an
    unpatched pass is "passes", not "not reproduced"; where it declares an error, it stays "not reproduced"."""
    row = selftest.Row("p/s", "p", "", True, "gate", expected_error="RuntimeError", declared_unpatched="")
    row.unpatched = {"passed": True, "error_type": None}
    row.patched = {"passed": True, "error_type": None, "max_abs_diff": 0.0}
    assert (selftest.judge(row).verdict, row.ok) == ("passes", True)
    row.declared_unpatched = "RuntimeError"
    assert selftest.judge(row).verdict == "not reproduced"


def test_a_bug_path_this_machine_does_not_take_is_not_applicable():
    """A scenario whose unpatched run passed because the bug's code path is not taken here says why
    (``not_reproducible_here``): n/a with that reason, exit code unchanged; a failing patched run still fails."""
    row = selftest.Row("p/s", "p", "", True, "gate", expected_error="AssertionError", declared_unpatched="AssertionError")
    row.unpatched = {"passed": True, "error_type": None, "metrics": {"not_reproducible_here": "no AVX512-BF16"}}
    row.patched = {"passed": True, "error_type": None, "max_abs_diff": 0.0}
    assert (selftest.judge(row).verdict, row.ok, row.not_applicable) == ("n/a (no AVX512-BF16)", True, "no AVX512-BF16")
    row.patched = {"passed": False, "error_type": "AssertionError", "error": "x", "traceback_tail": ""}
    row.not_applicable = None
    assert (selftest.judge(row).verdict, row.ok) == ("FAILED", False)


def test_a_misspelt_device_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setenv("METAPATCH_SELFTEST_DEVICE", "gpu0")
    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    assert selftest.run(parser.parse_args([])) == 2
    err = capsys.readouterr().err
    assert err.strip() == "metapatch selftest: METAPATCH_SELFTEST_DEVICE='gpu0': expected cpu, cuda, cuda:N or auto"


def test_rows_record_the_device_and_the_pin():
    from metapatch.selftest import Outcome

    row = selftest.Row("p/s", "p", "", True, "gate", expected_error="E")
    unpatched = Outcome("p/s", False, False, "E", "x", device="cpu", device_note="two ranks over gloo")
    patched = Outcome("p/s", True, True, metrics={"max_abs_diff": 0.0}, device="cpu", device_note="two ranks over gloo")
    row = selftest.finish_row(row, unpatched, patched, 1.0)
    assert (row.device, row.device_note, row.verdict) == ("cpu", "two ranks over gloo", "fixed")
    assert selftest.cells(row)[4] == "cpu*" and "    cpu*: two ranks over gloo" in selftest.format_details(row)
    assert selftest.summary_line([row], 1.0).endswith("Computed on cpu (pinned): 1.")


# -- n/a: a scenario whose model class is missing -------------------------------------------------
# A synthetic scenario module (written to a temporary folder that the child runs get on their path)
# so that these tests do not depend on which transformers is installed.

SYNTHETIC = """
from metapatch.selftest import NotApplicable

def missing_class(workdir):
    raise NotApplicable("needs transformers >= 99.0 (ImaginaryForCausalLM)")

def import_error(workdir):
    from metapatch import ImaginaryForCausalLM  # the author forgot to check: must stay a failure
    return {}

def missing_submodule(workdir):
    import metapatch.models_that_do_not_exist  # a dotted module, not a missing distribution
    return {}

def works(workdir):
    return {"max_abs_diff": 0.0}
"""


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    folder = tmp_path / "synthetic"
    folder.mkdir()
    (folder / "synthetic_scenarios.py").write_text(SYNTHETIC)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("METAPATCH_SELFTEST_FORK", "0")  # fresh interpreters read PYTHONPATH; the warm parent does not
    scenarios = {name: Scenario("synthetic-patch", name, f"synthetic_scenarios:{name.replace('-', '_')}",
                                expected_error="KeyError")
                 for name in ("missing-class", "import-error", "missing-submodule", "works")}
    return scenarios


def _run_cli(monkeypatch, capsys, scenarios, *extra):
    import metapatch.selftest as selftest_package

    monkeypatch.setattr(selftest_package, "all_scenarios", lambda: list(scenarios))
    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    code = selftest.run(parser.parse_args(list(extra)))
    return code, capsys.readouterr().out


def test_not_applicable_outcome_is_neither_pass_nor_failure(synthetic):
    outcome = run_scenario(synthetic["missing-class"], patched=False)
    assert outcome.not_applicable == "needs transformers >= 99.0 (ImaginaryForCausalLM)"
    assert outcome.passed is False and outcome.error_type == "NotApplicable"
    works = run_scenario(synthetic["works"], patched=True)
    assert works.passed and works.not_applicable is None


def test_import_error_of_a_model_class_is_not_turned_into_na(synthetic):
    for name, error_type in (("import-error", "ImportError"), ("missing-submodule", "ModuleNotFoundError")):
        outcome = run_scenario(synthetic[name], patched=False)
        assert (outcome.passed, outcome.not_applicable, outcome.error_type) == (False, None, error_type)


def test_selftest_reports_na_and_keeps_exit_code_0(synthetic, monkeypatch, capsys):
    code, out = _run_cli(monkeypatch, capsys, [synthetic["missing-class"], synthetic["works"]])
    lines = out.splitlines()
    row = next(line for line in lines if line.startswith("synthetic-patch/missing-class"))
    assert row.split()[2] == "n/a"  # the unpatched column
    assert row.endswith("n/a (needs transformers >= 99.0 (ImaginaryForCausalLM))")
    assert "FAILED" not in out and "passed" not in row
    assert lines[-1].startswith("2 scenarios in") and "1 n/a" in lines[-1] and "1 passes" in lines[-1]
    assert "fixes every affected scenario" in lines[-1]
    assert code == 0


def test_selftest_json_reports_na_with_its_own_status(synthetic, monkeypatch, capsys):
    code, out = _run_cli(monkeypatch, capsys, [synthetic["missing-class"]], "--json")
    data = json.loads(out)
    (row,) = data["rows"]
    assert row["verdict"] == "n/a (needs transformers >= 99.0 (ImaginaryForCausalLM))"
    assert row["not_applicable"] == "needs transformers >= 99.0 (ImaginaryForCausalLM)"
    assert row["ok"] is True and row["patched"] is None  # the patched run is not needed
    assert row["unpatched"]["not_applicable"] == row["not_applicable"] and not row["unpatched"]["passed"]
    assert data["nothing_ran"] is True and code == data["exit_code"] == 1  # nothing was checked


def _renamed(scenario, patch_id):
    return Scenario(patch_id, scenario.name, scenario.function, expected_error=scenario.expected_error)


def test_quick_selftest_runs_one_decisive_scenario_per_patch(synthetic, monkeypatch, capsys):
    """The default run goes through each patch's scenarios until one applies here: an n/a scenario
    is followed by the next, and a patch's later scenarios are not run once one has decided."""
    first = [_renamed(synthetic["missing-class"], "patch-a"), _renamed(synthetic["works"], "patch-a"),
             _renamed(synthetic["import-error"], "patch-a")]
    second = [_renamed(synthetic["import-error"], "patch-b"), _renamed(synthetic["works"], "patch-b")]
    code, out = _run_cli(monkeypatch, capsys, first + second, "--json", "--jobs", "2")
    data = json.loads(out)
    ran = [row["scenario"] for row in data["rows"]]
    assert ran == ["patch-a/missing-class", "patch-a/works", "patch-b/import-error"]
    assert data["selection"] == "one per patch"
    assert code == data["exit_code"] == 1  # patch-b's decisive scenario failed


def test_all_runs_every_scenario_and_progress_goes_to_stderr(synthetic, monkeypatch, capsys):
    import metapatch.selftest as selftest_package

    chosen = [_renamed(synthetic["works"], "patch-a"), _renamed(synthetic["works"], "patch-b"),
              _renamed(synthetic["missing-class"], "patch-b")]
    monkeypatch.setattr(selftest_package, "all_scenarios", lambda: list(chosen))
    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    code = selftest.run(parser.parse_args(["--all", "--jobs", "2"]))
    captured = capsys.readouterr()
    rows = [line.split()[0] for line in captured.out.splitlines()[1:-1]]
    assert sorted(rows) == ["patch-a/works", "patch-b/missing-class", "patch-b/works"]
    assert captured.out.splitlines()[-1].startswith("3 scenarios in")
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[1/3", "[2/3", "[3/3"]
    assert " left]" in progress[0] and " left]" not in progress[-1] and "elapsed" in progress[-1]
    assert {line.split("] ", 1)[1].split(":")[0] for line in progress} == set(rows)  # which scenario
    assert code == 0


def test_selftest_import_error_still_fails_the_run(synthetic, monkeypatch, capsys):
    code, out = _run_cli(monkeypatch, capsys, [synthetic["missing-class"], synthetic["import-error"],
                                               synthetic["missing-submodule"]], "--json", "--all")
    rows = {row["scenario"]: row for row in json.loads(out)["rows"]}
    assert rows["synthetic-patch/import-error"]["verdict"] == "FAILED"
    assert rows["synthetic-patch/missing-submodule"]["verdict"] == "FAILED"
    assert rows["synthetic-patch/missing-class"]["verdict"].startswith("n/a (")
    assert code == 1


@pytest.mark.parametrize("unpatched_na, patched_na, verdict, ok", [
    ("needs x", None, "n/a (needs x)", True),       # the patched run is skipped
    ("needs x", "needs x", "n/a (needs x)", True),
])
def test_na_verdicts(unpatched_na, patched_na, verdict, ok):
    row = selftest.Row("p/s", "p", "", True, "gate", expected_error="E")
    row.unpatched = {"passed": False, "error_type": "NotApplicable", "not_applicable": unpatched_na}
    if patched_na:
        row.patched = {"passed": False, "error_type": "NotApplicable", "not_applicable": patched_na}
    row = selftest.judge(row)
    assert (row.verdict, row.ok) == (verdict, ok)
    assert selftest.exit_code([_row(True, "E", False, True), row]) == 0


def test_na_in_only_one_run_is_a_failure():
    row = selftest.Row("p/s", "p", "", True, "gate", expected_error="E")
    row.unpatched = {"passed": False, "error_type": "KeyError", "not_applicable": None}
    row.patched = {"passed": False, "error_type": "NotApplicable", "not_applicable": "needs x",
                   "error": "needs x", "traceback_tail": ""}
    assert (selftest.judge(row).verdict, row.ok) == ("FAILED", False)
    assert any("n/a in only one of the two runs" in line for line in selftest.format_details(row))


# -- doctor ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from metapatch.selftest._models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("doctor") / "ckpt")


def _hashes(folder: Path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_doctor_auto_map_with_max_memory_offloads_and_runs(checkpoint, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = _hashes(checkpoint)
    proc = _cli("doctor", str(checkpoint), "--device-map", "auto", "--max-memory", "cpu=300KB",
                "--offload-folder", str(tmp_path / "offload"), "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["loaded"] and data["forward"]["ran"] and data["forward"]["finite"]
    assert data["forward"]["shape"] == [1, 8, 128]
    assert "disk" in data["hf_device_map"].values()
    assert [f["code"] for f in data["report"]["findings"]] == ["offloaded"]
    assert data["report"]["ok"] is True
    assert _hashes(checkpoint) == before, "doctor changed the checkpoint"
    assert list(cwd.iterdir()) == [], "doctor wrote into the working directory"


def test_doctor_reports_meta_model_device_and_exits_1(checkpoint, tmp_path):
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu",
                  "model.norm": "cpu", "lm_head": "cpu"}
    args = ("doctor", str(checkpoint), "--device-map", json.dumps(device_map),
            "--offload-folder", str(tmp_path / "offload"))
    # metapatch's offloaded-model-device answers it: nothing to report.
    proc = _cli(*args)
    assert proc.returncode == 0 and "model-device-meta" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    # Upstream's model.device (the patch disabled): the finding, naming the patch.
    proc = _cli(*args, env={"METAPATCH_DISABLE": "offloaded-model-device,offloaded-model-device-v4"})
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "[error] model-device-meta" in proc.stdout
    assert "inputs.to('cpu')" in proc.stdout and "offloaded-model-device" in proc.stdout
    assert "forward pass: ok" in proc.stdout  # the model runs; the report is about inputs.to(model.device)


def test_doctor_rejects_bad_arguments(tmp_path):
    proc = _cli("doctor", str(tmp_path), "--device-map", "{not json")
    assert proc.returncode == 2 and "config.json" in proc.stderr  # checked before the map
    (tmp_path / "config.json").write_text("{}")
    proc = _cli("doctor", str(tmp_path), "--device-map", "{not json")
    assert proc.returncode == 2 and "--device-map is not valid JSON" in proc.stderr


@pytest.fixture(scope="module")
def other_checkpoints(tmp_path_factory):
    """A tiny T5 (encoder-decoder) and a tiny Llama sequence classifier."""
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("doctor-kinds")
    torch.manual_seed(0)
    t5 = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                               num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    transformers.T5ForConditionalGeneration(t5).save_pretrained(root / "t5")
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, num_labels=3)
    transformers.LlamaForSequenceClassification(llama).save_pretrained(root / "cls")
    return root


@pytest.mark.parametrize("kind, device_map, shape", [
    ("t5", {"shared": "cpu", "encoder": "disk", "decoder": "cpu", "lm_head": "cpu"}, [1, 1, 64]),
    ("cls", {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
             "score": "cpu"}, [1, 3]),
])
def test_doctor_runs_encoder_decoder_and_classification_models(other_checkpoints, tmp_path, kind, device_map, shape):
    proc = _cli("doctor", str(other_checkpoints / kind), "--device-map", json.dumps(device_map),
                "--offload-folder", str(tmp_path / "offload"), "--json")
    data = json.loads(proc.stdout)
    assert data["forward"]["ran"], data["forward"]
    assert data["forward"]["shape"] == shape and data["forward"]["finite"]
    assert data["ok"] is True and proc.returncode == 0, proc.stderr[-2000:]
    (offloaded,) = [f for f in data["report"]["findings"] if f["code"] == "offloaded"]
    # counted as placed: the map's disk entry, not accelerate's hooks on its leaf modules
    modules, tensors = offloaded["summary"].split(" module(s) (")
    assert int(modules) == len(offloaded["items"]) and all(item.endswith("(disk)") for item in offloaded["items"])
    assert int(tensors.split()[0]) > int(modules)  # the tensors are counted apart
    if kind == "t5":  # the text report ends with the verdict, after the forward pass it covers
        text = _cli("doctor", str(other_checkpoints / kind), "--device-map", json.dumps(device_map),
                    "--offload-folder", str(tmp_path / "offload-text"))
        assert text.stdout.rstrip().endswith("verdict: ok") and "forward pass: ok" in text.stdout


def test_doctor_verdict_follows_a_failed_forward():
    from metapatch.diagnose import Report

    forward = {"ran": False, "error_type": "ValueError", "error": "boom"}
    assert doctor.verdict_text(Report("M", {}, True), forward) == "  verdict: problems found: the forward pass failed"
    assert not doctor.forward_ok(forward) and doctor.forward_ok(None) and doctor.forward_ok({"skipped": "no ids"})


@pytest.mark.parametrize("make_args, message", [
    (lambda ck, tmp: ["--device-map", '{"model.nonexistent": "cpu"}'], "names 1 module(s) LlamaForCausalLM does not have"),
    (lambda ck, tmp: ["--device-map", str(tmp / "missing.json")], "missing.json: no such file"),
    (lambda ck, tmp: ["--device-map", "sideways"], "is none of auto"),
    (lambda ck, tmp: ["--device-map", '{"model": "cuda:7"}'], "is not on this machine"),
    (lambda ck, tmp: ["--dtype", "float17"], "is not a torch dtype"),
    (lambda ck, tmp: ["--max-memory", "cpu=lots"], "is not a size"),
    (lambda ck, tmp: ["--offload-folder", str(ck / "config.json")], "is not a folder"),
])
def test_doctor_bad_input_is_one_line_and_exit_2(checkpoint, tmp_path, make_args, message):
    proc = _cli("doctor", str(checkpoint), *make_args(checkpoint, tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("metapatch doctor:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_argument_parsers():
    assert doctor.parse_max_memory("cpu=2GiB, 0=20GiB") == {"cpu": "2GiB", 0: "20GiB"}
    assert doctor.parse_max_memory(None) is None
    with pytest.raises(metapatch.MetapatchError, match="DEVICE=SIZE"):
        doctor.parse_max_memory("cpu:2GiB")
    assert doctor.parse_device_map("auto") == "auto"
    assert doctor.parse_device_map('{"model": "0", "lm_head": "cpu"}') == {"model": 0, "lm_head": "cpu"}
    with pytest.raises(metapatch.MetapatchError, match="object"):
        doctor.parse_device_map('["cpu"]')
