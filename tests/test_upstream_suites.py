"""Upstream's own tests, from the released sdists of the installed versions, run without and with
metapatch: the outcome of every test must be the same.

accelerate: tests/test_big_modeling.py, test_hooks.py, test_modeling_utils.py, test_offload.py give
the same pass/fail/skip set with metapatch active as without it.

peft: its offload tests (TestOffloadSave in tests/test_gpu_examples.py) need an accelerator, the hub
and `datasets`, so run as they are they would skip (or fail to collect) in both runs and prove
nothing. tests/_peft_offload_suite.py generates, into tmp_path, a CPU-runnable copy of them from the
installed peft's sdist (tiny local GPT-2/OPT checkpoints, memory limits rescaled to them; the rewrite
is listed there). Both runs use peft's own markers and filterwarnings (copied from its pyproject,
without its pytest-cov addopts) and `-W ignore::FutureWarning`: peft's filterwarnings turns
transformers' FutureWarnings into errors, and transformers 5.24 raises one from peft's own code
(`is_gradient_checkpointing` is deprecated), which would fail every test in both runs. Without metapatch:
METAPATCH_DISABLE=all, metapatch neither on PYTHONPATH nor loaded as a plugin (the run's conftest
records that it was not imported). With metapatch every CPU-runnable offload test must pass; tests
that fail without it and pass with it are printed as the evidence. `pytest -s` shows the counts.

Needs PyPI for the sdists; without it the test is skipped with that reason.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITES = {
    "accelerate": ["tests/test_big_modeling.py", "tests/test_hooks.py", "tests/test_modeling_utils.py",
                   "tests/test_offload.py"],
}  # peft: test_peft_offload_tests_pass_with_metapatch, on a generated CPU copy
# Beyond the four offload files, CPU-runnable files that reach what metapatch wraps
# outside big_modeling/hooks: test_accelerator.py (Accelerator.prepare -> prepare_model, wrapped by the FSDP
# patches; saving/loading models with offload hooks), test_utils.py (the offload and state-dict helpers,
# extract_submodules_state_dict among them), test_quantization.py (load_checkpoint_and_dispatch and
# load_checkpoint_in_model with bitsandbytes; what runs without a GPU). Marked slow: the latest pair only.
MORE = {"accelerate": ["tests/test_accelerator.py", "tests/test_utils.py", "tests/test_quantization.py"]}
OUTCOMES = ("passed", "failed", "skipped")


@pytest.fixture(scope="session")
def sdist_root(tmp_path_factory):
    def get(dist: str) -> Path:
        version = importlib.metadata.version(dist)
        dest = tmp_path_factory.mktemp(f"{dist}-sdist")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                               f"{dist}=={version}", "-d", str(dest)], capture_output=True, text=True, timeout=300)
        archives = list(dest.glob("*.tar.gz"))
        if proc.returncode != 0 or not archives:
            pytest.skip(f"could not download the {dist} {version} sdist from PyPI: {proc.stderr.strip()[-300:]}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(dest, filter="data")
        return next(p for p in dest.iterdir() if p.is_dir())

    return get


def _outcomes(root: Path, tests: list, *, with_metapatch: bool, report: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO))
    if not with_metapatch:
        env["METAPATCH_DISABLE"] = "all"
    else:
        env["METAPATCH_STRICT"] = os.environ.get("METAPATCH_STRICT", "")
    # Same command both times; only METAPATCH_DISABLE differs. `-p metapatch` imports it before the tests.
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "metapatch", "-p", "no:cacheprovider",
                    "-o", "addopts=", f"--junitxml={report}", *tests],
                   cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert report.exists(), f"pytest wrote no report for {tests}"
    return {key: outcome for key, (outcome, _) in _read_report(report).items()}


def _read_report(report: Path) -> dict:
    """test id -> (outcome, first line of the failure or skip message) from a junit xml report."""
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        found = next((kinds[k] for k in ("failure", "error", "skipped") if k in kinds), None)
        outcome = "passed" if found is None else "skipped" if found.tag == "skipped" else "failed"
        message = ((found.get("message") or "").strip().splitlines() or [""])[0][:300] if found is not None else ""
        results[key] = (outcome, message)
    return results


def _counts(outcomes: dict) -> dict:
    return {o: list(outcomes.values()).count(o) for o in OUTCOMES}


def _repeated(first: dict, again) -> dict:
    """The differences (test id -> (without, with)) that a second pair of runs shows again. A test whose
    outcome changes between two runs of the same command (timing, ports, random state) is flaky: it is
    printed, not counted against metapatch. ``again()`` re-runs both sides and returns their differences;
    it is called only when ``first`` is not empty, so a clean run costs one pair."""
    if not first:
        return first
    second = again()
    flaky = sorted(set(first) - set(second))
    if flaky:
        print(f"  flaky (differed once, not in the second pair of runs): {flaky}")
    return {k: v for k, v in first.items() if second.get(k) == v}


@pytest.mark.parametrize("dist", list(SUITES))
def test_upstream_suite_unchanged_by_metapatch(dist, sdist_root, tmp_path):
    root = sdist_root(dist)

    def differences(tag: str = "") -> tuple:
        without = _outcomes(root, SUITES[dist], with_metapatch=False, report=tmp_path / f"without{tag}.xml")
        with_ = _outcomes(root, SUITES[dist], with_metapatch=True, report=tmp_path / f"with{tag}.xml")
        return without, with_, {k: (without.get(k), with_.get(k)) for k in set(without) | set(with_)
                                if without.get(k) != with_.get(k)}

    without, with_, changed = differences()
    assert without, f"no {dist} tests were collected"
    changed = _repeated(changed, lambda: differences("-again")[2])
    counts = {name: _counts(d) for name, d in (("without", without), ("with", with_))}
    print(f"{dist} {importlib.metadata.version(dist)}: {counts}")
    assert not changed, f"metapatch changed upstream {dist} outcomes (without -> with): {changed}"


@pytest.mark.slow
@pytest.mark.parametrize("dist", list(MORE))
def test_more_upstream_files_unchanged_by_metapatch(dist, sdist_root, tmp_path):
    root = sdist_root(dist)

    def differences(tag: str = "") -> tuple:
        without = _outcomes(root, MORE[dist], with_metapatch=False, report=tmp_path / f"without{tag}.xml")
        with_ = _outcomes(root, MORE[dist], with_metapatch=True, report=tmp_path / f"with{tag}.xml")
        return without, with_, {k: (without.get(k), with_.get(k)) for k in set(without) | set(with_)
                                if without.get(k) != with_.get(k)}

    without, with_, changed = differences()
    assert without, f"no {dist} tests were collected"
    only_with = sorted(k for k in with_ if with_[k] == "failed" and without.get(k) != "failed")
    fixed = sorted(k for k in with_ if with_[k] == "passed" and without.get(k) == "failed")
    changed = _repeated(changed, lambda: differences("-again")[2])
    print(f"{dist} {importlib.metadata.version(dist)} {MORE[dist]}: "
          f"{ {name: _counts(d) for name, d in (('without', without), ('with', with_))} }\n"
          f"  fail only with metapatch: {only_with or 'none'}\n  fixed by metapatch: {fixed or 'none'}")
    assert not changed, f"metapatch changed upstream {dist} outcomes (without -> with): {changed}"


def _run_peft_suite(suite, *, with_metapatch: bool, out: Path) -> tuple:
    """(test id -> (outcome, message), {"imported": bool, "applied": [...]}) for one run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_") and k != "PYTHONPATH"}
    state, report = out.with_suffix(".json"), out.with_suffix(".xml")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PEFT_OFFLOAD_SUITE_STATE=str(state))
    plugin = []
    if with_metapatch:
        env.update(PYTHONPATH=str(REPO), METAPATCH_STRICT=os.environ.get("METAPATCH_STRICT", ""))
        plugin = ["-p", "metapatch"]
    else:
        env["METAPATCH_DISABLE"] = "all"
    folder = suite.path.parent
    # The folder's pytest.ini carries peft's markers and filterwarnings; FutureWarning: see the docstring.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *plugin, "-p", "no:cacheprovider",
                           "--rootdir", str(folder), "-W", "ignore::FutureWarning", f"--junitxml={report}",
                           suite.path.name], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert report.exists() and state.exists(), \
        f"the generated peft suite did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = {key.rsplit(".", 1)[-1]: value for key, value in _read_report(report).items()}
    return results, json.loads(state.read_text())


def test_peft_offload_tests_pass_with_metapatch(sdist_root, tmp_path):
    from _peft_offload_suite import build_suite, save_tiny_checkpoints  # tests/_peft_offload_suite.py

    version = importlib.metadata.version("peft")
    root = sdist_root("peft")
    suite = build_suite(root, tmp_path / "suite", save_tiny_checkpoints(tmp_path / "models"), version)
    without, without_state = _run_peft_suite(suite, with_metapatch=False, out=tmp_path / "without")
    with_, with_state = _run_peft_suite(suite, with_metapatch=True, out=tmp_path / "with")

    fixed = sorted(k for k in with_ if with_[k][0] == "passed" and without.get(k, ("",))[0] != "passed")
    broken = sorted(k for k in with_ if with_[k][0] != "passed" and without.get(k, ("",))[0] == "passed")
    counts = {"without": _counts({k: v[0] for k, v in without.items()}),
              "with": _counts({k: v[0] for k, v in with_.items()})}
    summary = "\n".join([
        f"peft {version} offload tests (CPU copy of {suite.source_class}): {counts}",
        *(f"  {name}: without {without.get(name, ('missing',))[0]}, with {with_.get(name, ('missing',))[0]}"
          + (f" ({without[name][1]})" if without.get(name, ("",))[0] == "failed" else "") for name in suite.tests),
        *(f"  unexpected report entry: {name}: {outcome} {message}" for run in (without, with_)
          for name, (outcome, message) in run.items() if name not in suite.tests),
        f"  fixed by metapatch (fail without, pass with): {fixed or 'none'}",
        f"  patches applied in the metapatch run: {', '.join(with_state['applied']) or 'none'}",
        *(f"  not CPU-runnable: {name}: {why}" for name, why in suite.left_out.items()),
        *(f"  rewrite: {note}" for note in suite.notes),
    ])
    print(summary)
    assert not without_state["imported"], f"metapatch was imported in the run without it\n{summary}"
    assert with_state["imported"], f"metapatch was not imported in the run with it\n{summary}"
    assert sorted(without) == sorted(with_) == sorted(suite.tests), f"collected tests differ\n{summary}"
    failing = {k: v for k, v in with_.items() if v[0] != "passed"}
    assert not failing, (f"peft offload tests that do not pass with metapatch: {failing}; "
                         f"passed without it, fail with it: {broken or 'none'}\n{summary}")


# -- peft's general test files, a fixed sample ------------------------------------------------------------


def _run_peer_suite(built: dict, *, with_metapatch: bool, out: Path, full: bool) -> tuple:
    from _peer_suites import FILES, environment  # tests/_peer_suites.py

    state, report = out.with_suffix(".json"), out.with_suffix(".xml")
    env = environment(dict(os.environ), built["stubs"], REPO, with_metapatch=with_metapatch, state=state, full=full)
    plugin = ["-p", "metapatch"] if with_metapatch else []
    folder = built["suite"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *plugin, "-p", "no:cacheprovider", "--rootdir",
                           str(folder), "-W", "ignore::FutureWarning", f"--junitxml={report}", *FILES],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=7200 if full else 1200)
    assert report.exists() and state.exists(), \
        f"the peft peer suite did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return _read_report(report), json.loads(state.read_text())


@pytest.mark.slow
def test_peft_peer_suites_unchanged_by_metapatch(sdist_root, tmp_path):
    """peft's tests/test_custom_models.py (a fixed sample: TestPeftCustomModel's save/load, low_cpu_mem_usage,
    merge, multiple-adapter, disable/delete and training tests over LoRA (plain, DoRA, lora_b bias, trainable
    tokens; Linear, Embedding, Conv1D, Conv2d, MHA), IA3, LoHa, LoKr, OFT, BOFT, VeRA, AdaLoRA and trainable
    tokens cases, and the whole TestMultipleActiveAdapters and TestRequiresGrad), test_other.py (whole) and
    test_initialization.py (its LoRA classes; CPU), from the installed peft's sdist (tests/_peer_suites.py: the
    sample, and why stubs stand in for diffusers/datasets). The same command without metapatch
    (METAPATCH_DISABLE=all, not imported) and with it (`-p metapatch`); outcomes compared per test id: no test
    may fail only with metapatch. Printed (`pytest -s`): counts, tests that fail only with metapatch, tests
    fixed by it, tests failing in both runs.

    The full files (every test of the three, ~20k; hours on one core):
        METAPATCH_PEER_FULL=1 python -m pytest -s -p no:cacheprovider -n 0 \\
            tests/test_upstream_suites.py -k test_peft_peer_suites_unchanged_by_metapatch
    Marked slow: CI runs it on the latest pair only."""
    from _peer_suites import build
    from _peft_offload_suite import _pytest_ini

    full = os.environ.get("METAPATCH_PEER_FULL") == "1"
    version = importlib.metadata.version("peft")
    root = sdist_root("peft")
    built = build(root, tmp_path / "peer", _pytest_ini(root))
    without, without_state = _run_peer_suite(built, with_metapatch=False, out=tmp_path / "without", full=full)
    with_, with_state = _run_peer_suite(built, with_metapatch=True, out=tmp_path / "with", full=full)

    def fails_only_with(without: dict, with_: dict) -> dict:
        return {k: (without.get(k, ("",))[0], with_[k][0]) for k in with_
                if with_[k][0] == "failed" and without.get(k, ("",))[0] != "failed"}

    def again() -> dict:
        rerun = [_run_peer_suite(built, with_metapatch=flag, out=tmp_path / f"{name}-again", full=full)[0]
                 for flag, name in ((False, "without"), (True, "with"))]
        return fails_only_with(*rerun)

    confirmed = _repeated(fails_only_with(without, with_), again)
    only_with = sorted(confirmed)
    fixed = sorted(k for k in with_ if with_[k][0] == "passed" and without.get(k, ("",))[0] == "failed")
    both = sorted(k for k in with_ if with_[k][0] == "failed" and without.get(k, ("",))[0] == "failed")
    counts = {"without": _counts({k: v[0] for k, v in without.items()}),
              "with": _counts({k: v[0] for k, v in with_.items()})}
    summary = "\n".join([
        f"peft {version} peer suites ({'full' if full else 'sample'}): {counts}",
        *(f"  FAILS ONLY WITH METAPATCH: {k}: {with_[k][1]}" for k in only_with),
        *(f"  fixed by metapatch: {k}" for k in fixed),
        *(f"  fails in both runs: {k}: {without[k][1]}" for k in both),
        f"  patches applied in the metapatch run: {', '.join(with_state['applied']) or 'none'}",
    ])
    print(summary)
    assert not without_state["imported"], f"metapatch was imported in the run without it\n{summary}"
    assert with_state["imported"] and "peft-offload-redispatch" in with_state["applied"], \
        f"metapatch's peft patch was not active in the run with it\n{summary}"
    assert without, f"no peft tests were collected\n{summary}"
    assert sorted(without) == sorted(with_), f"collected tests differ\n{summary}"
    assert not only_with, f"peft tests that fail only with metapatch: {only_with}\n{summary}"
