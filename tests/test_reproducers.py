"""The standalone reproducers that `metapatch pr` puts whole into each PR body
(upstream_diffs/<id>/reproducer.py): each runs with plain `python`, metapatch neither
imported nor on the path, on the installed stack, and fails with the error its docstring names (or one of
the alternatives it names by release, ``Fails with: ValueError|AssertionError``)
where the installed versions have the bug, or passes where they do not.

"Where they have the bug": the patch's affected range (`registry.gate`), or, for a reproducer
marked ``Affected: diff``, the diff's own verdict against the installed package (``applies``: the
bug is there), or, for ``Affected: <patch id>, <patch id>`` (the same bug patched separately in
other releases, e.g. a 4.x twin), any of those patches' affected ranges. Short by design: under 60 lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from metapatch import diffs, registry
from metapatch.commands.pr_body import failure_classes, reproducer_fields

ROOT = Path(__file__).resolve().parents[1]
NOT_APPLICABLE = 77  # a reproducer's exit code when the installed release lacks its model class
REPRODUCERS = sorted((ROOT / "upstream_diffs").glob("*/reproducer.py"))


def _needs_the_bug(patch_id: str, fields: dict) -> bool:
    if fields.get("Affected") == "diff":
        return all(diffs.check(d).verdict == diffs.APPLIES for d in diffs.diffs_for(patch_id))
    if fields.get("Affected"):
        return any(registry.gate(registry.patches[p]).affected for p in re.split(r"[,\s]+", fields["Affected"]) if p)
    return registry.gate(registry.patches[patch_id]).affected


@pytest.mark.parametrize("path", REPRODUCERS, ids=[p.parent.name for p in REPRODUCERS])
def test_reproducer_runs_alone_and_fails_where_affected(path, tmp_path):
    source = path.read_text()
    assert len(source.splitlines()) < 60, f"{path} is not short"
    assert "import metapatch" not in source and "from ." not in source  # upstream packages only
    fields = reproducer_fields(source)
    assert fields.get("Fails with"), f"{path} names no error (a 'Fails with:' line in its docstring)"
    patch_id = path.parent.name
    assert patch_id in registry.patches
    for package in {d.package for d in diffs.diffs_for(patch_id)}:
        pytest.importorskip(package)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_") and k != "PYTHONPATH"}
    env["METAPATCH_AUTOLOAD"] = "0"  # an enabled venv's .pth hook must not import metapatch either
    run = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    output = run.stdout + run.stderr
    if run.returncode == NOT_APPLICABLE:  # the model class it needs is missing from this release
        pytest.skip(f"{patch_id}: {output.strip()[-300:]}")
    if _needs_the_bug(patch_id, fields):
        last = output.strip().splitlines()[-1] if output.strip() else ""
        assert run.returncode != 0 and any(last.startswith(name + ":") for name in failure_classes(fields)), output[-3000:]
    else:
        assert run.returncode == 0, output[-3000:]


def test_fails_with_names_one_error_or_alternatives():
    assert failure_classes({"Fails with": "KeyError"}) == ["KeyError"]
    assert failure_classes({"Fails with": "ValueError|AssertionError"}) == ["ValueError", "AssertionError"]
    assert failure_classes({}) == []
