"""Upstream's own tests, from the released sdists of the installed versions, give the same
pass/fail/skip set with metapatch active as without it (issue 7).

accelerate: tests/test_big_modeling.py, test_hooks.py, test_modeling_utils.py, test_offload.py.
peft: the offload tests (TestOffloadSave in tests/test_gpu_examples.py; they need an accelerator and
the hub, so on CPU machines both runs skip them alike - the comparison still guards collection).

Needs PyPI for the sdists; without it the test is skipped with that reason.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SUITES = {
    "accelerate": ["tests/test_big_modeling.py", "tests/test_hooks.py", "tests/test_modeling_utils.py",
                   "tests/test_offload.py"],
    "peft": ["tests/test_gpu_examples.py::TestOffloadSave"],
}


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
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    if not with_metapatch:
        env["METAPATCH_DISABLE"] = "all"
    else:
        env["METAPATCH_STRICT"] = os.environ.get("METAPATCH_STRICT", "")
    # Same command both times; only METAPATCH_DISABLE differs. `-p metapatch` imports it before the tests.
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "metapatch", "-p", "no:cacheprovider",
                    "-o", "addopts=", f"--junitxml={report}", *tests],
                   cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert report.exists(), f"pytest wrote no report for {tests}"
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[key] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    return outcomes


@pytest.mark.parametrize("dist", list(SUITES))
def test_upstream_suite_unchanged_by_metapatch(dist, sdist_root, tmp_path):
    root = sdist_root(dist)
    without = _outcomes(root, SUITES[dist], with_metapatch=False, report=tmp_path / "without.xml")
    with_ = _outcomes(root, SUITES[dist], with_metapatch=True, report=tmp_path / "with.xml")
    assert without, f"no {dist} tests were collected"
    changed = {k: (without.get(k), with_.get(k)) for k in set(without) | set(with_) if without.get(k) != with_.get(k)}
    counts = {name: {o: list(d.values()).count(o) for o in ("passed", "failed", "skipped")}
              for name, d in (("without", without), ("with", with_))}
    print(f"{dist} {importlib.metadata.version(dist)}: {counts}")
    assert not changed, f"metapatch changed upstream {dist} outcomes (without -> with): {changed}"
