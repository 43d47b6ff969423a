"""`metapatch scaffold`: a new patch's pieces, written into a copy of the source checkout, load as a patch (status,
the INDEX, the test collection); an id that exists, a bad id or a bad range is one line and exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def checkout(tmp_path):
    """The parts of a source checkout scaffold writes into (the package, the patch tests' helpers, the diffs)."""
    root = tmp_path / "checkout"
    shutil.copytree(REPO / "metapatch", root / "metapatch", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "patches").mkdir(parents=True)
    for name in ("_three_way.py",):
        shutil.copy(REPO / "tests" / "patches" / name, root / "tests" / "patches" / name)
    (root / "upstream_diffs").mkdir()
    return root


def _metapatch(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("METAPATCH_DISABLE", None)
    return subprocess.run([sys.executable, "-m", "metapatch", *args], capture_output=True, text=True, cwd=str(root),
                          env=env, timeout=300)


def test_scaffold_writes_every_piece_and_the_record_loads(checkout):
    done = _metapatch(checkout, "scaffold", "json-dumps-demo", "--target", "json:dumps", "--affects",
                      "packaging=>=1", "--title", "a demonstration", "--root", str(checkout))
    assert done.returncode == 0, done.stderr
    for path in ("metapatch/patches/json_dumps_demo.py", "metapatch/selftest/json_dumps_demo.py",
                 "tests/patches/test_json_dumps_demo.py"):
        assert (checkout / path).is_file(), path
    assert (checkout / "upstream_diffs" / "json-dumps-demo").is_dir()
    # the INDEX was regenerated: the record is registered under its target module, and the check agrees
    assert "'json-dumps-demo': ('json_dumps_demo', ('json',))" in (checkout / "metapatch/patches/__init__.py").read_text()
    check = subprocess.run([sys.executable, "-m", "metapatch.patches", "--check"], cwd=str(checkout),
                           env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    status = _metapatch(checkout, "status", "json-dumps-demo")
    assert status.returncode == 0 and "json-dumps-demo: applied" in status.stdout, status.stdout + status.stderr
    import json

    from metapatch._framework.registry import fingerprint

    assert fingerprint(json.dumps) in (checkout / "metapatch/patches/json_dumps_demo.py").read_text()
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                                "tests/patches/test_json_dumps_demo.py"], cwd=str(checkout),
                               env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True)
    assert all(f"::TestThreeWay::test_{leg}[reproducer]" in collected.stdout for leg in ("unpatched", "patched", "upstream_diff_alone")), \
        collected.stdout + collected.stderr
    again = _metapatch(checkout, "scaffold", "json-dumps-demo", "--target", "json:dumps", "--affects",
                       "packaging=>=1", "--root", str(checkout))
    assert again.returncode == 2 and "exists already" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.parametrize("args, message", [
    (("Bad_Id", "--target", "json:dumps", "--affects", "packaging=>=1"), "is not a patch id"),
    (("json-x", "--target", "json:nope", "--affects", "packaging=>=1"), "has no nope"),
    (("json-x", "--target", "json:dumps", "--affects", "packaging"), "is not DIST=SPEC"),
    (("json-x", "--target", "json:dumps", "--affects", "packaging=one"), "is not a version range"),
])
def test_bad_input_is_one_line(checkout, args, message):
    done = _metapatch(checkout, "scaffold", *args, "--root", str(checkout))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (checkout / "metapatch/patches/json_x.py").exists()
