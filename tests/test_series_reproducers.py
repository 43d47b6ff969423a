"""The per-PR reproducers of a series of upstream diffs (``upstream_diffs/<id>/reproducer-N.py``,
one per ``<package>-N-<what>.diff``): each is what PR N's body shows, so each must fail on PR N's
base (the installed package with diffs 1..N-1 applied) with the error its docstring names, and pass
once diff N is applied too. Run with plain ``python -I``, metapatch neither imported nor on the path.

Where the series does not apply to the installed release (it is written against upstream main) the
reproducers are skipped with that reason. CI runs this file in one environment only (noxfile.py,
ONCE): the series is checked against one peft, the one every matrix environment pins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from metapatch import diffs
from metapatch.commands.pr_body import reproducer_fields

ROOT = Path(__file__).resolve().parents[1]
SERIES_REPRODUCERS = sorted((ROOT / "upstream_diffs").glob("*/reproducer-*.py"))


def _run(path: Path, cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_") and k != "PYTHONPATH"}
    env["METAPATCH_AUTOLOAD"] = "0"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # -I would drop PYTHONPATH: -E -s keep it out of the user's site and environment otherwise
    flags = ["-s"] if pythonpath else ["-I"]
    return subprocess.run([sys.executable, *flags, str(path)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("path", SERIES_REPRODUCERS, ids=[f"{p.parent.name}/{p.stem}" for p in SERIES_REPRODUCERS])
def test_series_reproducer_fails_on_its_base_and_passes_with_its_diff(path, tmp_path):
    source = path.read_text()
    assert len(source.splitlines()) < 60, f"{path} is not short"
    assert "import metapatch" not in source and "from ." not in source
    fields = reproducer_fields(source)
    assert fields.get("Fails with"), f"{path} names no error (a 'Fails with:' line in its docstring)"
    number = int(path.stem.rpartition("-")[2])
    series = [d for d in diffs.diffs_for(path.parent.name) if d.series_index is not None]
    assert [d.series_index for d in series][:number] == list(range(1, number + 1)), [d.path.name for d in series]
    pytest.importorskip(series[0].package)
    for n, diff in enumerate(series[:number]):
        verdict = diffs.check(diff, previous=series[:n])
        if verdict.verdict != diffs.APPLIES:
            pytest.skip(f"{diff.path.name} does not apply to the installed {diff.package} {verdict.installed} "
                        f"({verdict.verdict}): the series is written against upstream main")

    base = diffs.apply_to_copy(series[:number - 1], tmp_path / "base") if number > 1 else None
    before = _run(path, tmp_path, str(base) if base else "")
    output = before.stdout + before.stderr
    last = output.strip().splitlines()[-1] if output.strip() else ""
    assert before.returncode != 0 and last.startswith(fields["Fails with"] + ":"), output[-3000:]

    fixed = diffs.apply_to_copy(series[:number], tmp_path / "fixed")
    after = _run(path, tmp_path, str(fixed))
    assert after.returncode == 0, (after.stdout + after.stderr)[-3000:]
