"""The GPU lane (.ci/gpu_lane.py) is ready without a GPU: its CPU dry run (smoke size) runs every step that can
run on the CPU, reports the GPU-only ones skipped (never passed), stays within its budget and leaves at most 8
files with plain names; and its parts (wheel trimming and selection, the per-test report, the summary) do what
the GPU run relies on."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu_lane.py"


def _lane():
    spec = importlib.util.spec_from_file_location("gpu_lane", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lane = _lane()


def test_cpu_dry_run_reports_gpu_steps_skipped_and_fits_its_budget(tmp_path):
    pytest.importorskip("torch")
    for library in ("peft", "bitsandbytes"):  # the lane's env step imports them (on a GPU machine, from its wheels)
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"needs {library} (not installed here; the dry run uses the installed stack)")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run's meaning must not depend on the machine
    budget = 58
    run = subprocess.run([sys.executable, str(SCRIPT), "run", "--dry-run", "--smoke", "--wheels", str(tmp_path / "none"),
                          "--out", str(out), "--budget", str(budget), "--workers", "1"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=budget + 60)
    summary = json.loads((out / "summary.json").read_text())
    steps = {step["name"]: step for step in summary["steps"]}
    assert run.returncode == 0, (run.stdout[-3000:], summary["failed_steps"])
    assert summary["mode"].startswith("cpu dry run") and summary["wall_s"] <= budget
    assert [s["name"] for s in summary["steps"]] == ["install", "env", "gpu-tests", "selftest", "three-way", "bench",
                                                    "suite"]
    for gpu_only in ("gpu-tests", "three-way"):
        assert steps[gpu_only]["status"] == "skipped" and "CUDA" in steps[gpu_only]["note"]
    assert steps["env"]["status"] == "passed"
    # A loaded machine may cut the later steps by the budget: then they say so (partial, or skipped for want of
    # time), and never claim a pass they did not earn.
    for name in ("selftest", "bench", "suite"):
        step = steps[name]
        assert step["status"] == "passed" or "budget" in step["note"] or "cap" in step["note"], step
        assert step["status"] in ("passed", "partial", "skipped"), step
    if steps["selftest"]["status"] == "passed":
        assert steps["selftest"]["counts"] == {"fixed": 1}, steps["selftest"]
    if steps["bench"]["status"] == "passed":
        assert steps["bench"]["rows"][0]["name"].startswith("forward") and json.loads((out / "bench.json").read_text())
    if steps["suite"]["status"] == "passed":
        assert steps["suite"]["counts"].get("passed", 0) > 0
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files), files
    assert summary["markdown"] == (out / "summary.md").read_text().rstrip("\n")
    assert "| gpu-tests | skipped |" in summary["markdown"]


def test_trim_keeps_only_the_cpu_and_cuda13_libraries(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    names = ["bitsandbytes/__init__.py", "bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so",
             "bitsandbytes/libbitsandbytes_cuda121.so", "bitsandbytes/libbitsandbytes_cuda128.so",
             "bitsandbytes-0.50.2.dist-info/RECORD"]
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in names:
            archive.writestr(name, b"x")
    dropped = lane.trim_bitsandbytes(wheel)
    assert sorted(dropped) == ["libbitsandbytes_cuda121.so", "libbitsandbytes_cuda128.so"]
    assert sorted(zipfile.ZipFile(wheel).namelist()) == sorted(set(names) - {
        "bitsandbytes/libbitsandbytes_cuda121.so", "bitsandbytes/libbitsandbytes_cuda128.so"})


def test_only_wheels_that_fit_the_interpreter_are_installed():
    from packaging.tags import Tag

    py312 = {Tag("cp312", "cp312", "manylinux_2_17_x86_64"), Tag("py3", "none", "any")}
    assert lane.wheel_fits("kernels-0.19.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", py312)
    assert lane.wheel_fits("peft-0.21.2-py3-none-any.whl", py312)
    assert not lane.wheel_fits("kernels-0.19.1-cp311-cp311-manylinux_2_17_x86_64.whl", py312)


def test_outcomes_count_what_finished_and_name_the_failures(tmp_path):
    report = tmp_path / "r.jsonl"
    rows = [("a::ok", "setup", "passed"), ("a::ok", "call", "passed"), ("a::ok", "teardown", "passed"),
            ("a::bad", "setup", "passed"), ("a::bad", "call", "failed"), ("a::skip", "setup", "skipped"),
            ("a::err", "setup", "failed"), ("a::late", "setup", "passed")]  # a::late was cut off mid-test
    report.write_text("".join(json.dumps({"nodeid": n, "when": w, "outcome": o, "error": "E boom"}) + "\n"
                              for n, w, o in rows))
    found = lane.outcomes_of(report)
    assert found["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert found["failures"] == ["a::bad: E boom", "a::err: E boom"]
    assert lane.outcomes_of(tmp_path / "missing.jsonl") == {"counts": {}, "failures": []}


def test_summary_markdown_names_the_run():
    summary = {"date": "2026-12-04 20:00 UTC", "mode": "gpu", "gpu": "NVIDIA H200", "devices": 1, "commit": "abc1234",
               "stack": {"python": "3.12.3", "torch": "2.11.0+cu130", "cuda_version": "13.0", "transformers": "5.25.0",
                         "accelerate": "1.16.0", "peft": "0.21.2", "bitsandbytes": "0.50.2"},
               "budget_s": 330, "wall_s": 301.5, "failed_steps": [],
               "steps": [{"name": "selftest", "status": "passed", "counts": {"fixed": 60}, "devices": {"cuda:0": 50},
                          "seconds": 30}]}
    text = lane.render_markdown(summary)
    assert text.startswith("### 2026-12-04 20:00 UTC: NVIDIA H200 (gpu)")
    assert "| selftest | passed | fixed 60 (devices: cuda:0 50) | 30 |" in text
    assert "301.5 s of a 330 s budget; no step failed" in text


def test_selftest_progress_lines_count_a_run_cut_short():
    text = ("metapatch selftest: warm parents ready in 18 s\n"
            "[1/63] a/x: FAILED (1 s) [0:01 elapsed, about 0:47 left]\n"
            "[2/63] b/y: fixed (0 s) [0:01 elapsed]\n"
            "[3/63] c/z: n/a (needs transformers<5.0.0.dev0 (installed: transformers 5.25.0)) (0 s) [0:05 elapsed]\n")
    rows = lane.selftest_progress(text)
    assert [(r["scenario"], r["verdict"], r["ok"]) for r in rows] == [
        ("a/x", "FAILED", False), ("b/y", "fixed", True),
        ("c/z", "n/a (needs transformers<5.0.0.dev0 (installed: transformers 5.25.0))", True)]
