"""`metapatch explain` on real tracebacks: each is captured by running a corpus reproducer without
metapatch (METAPATCH_DISABLE=all) on the installed stack, then fed to the command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from metapatch.reports import by_id

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from reports.test_reports import run_report  # noqa: E402


def explain(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    trace = tmp_path / "trace.txt"
    trace.write_text(text)
    code = ("import sys; from metapatch.cli import main; rc = main(['explain', sys.argv[1]]); "
            "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'peft') if m in sys.modules]; "
            "assert not heavy, heavy; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, str(trace)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def unpatched_traceback(report_id: str) -> str:
    leg = run_report(by_id()[report_id], legs="one")["unpatched"]
    if leg.get("not_applicable"):
        pytest.skip(leg["not_applicable"])
    assert not leg["passed"], f"{report_id} no longer fails without metapatch: pick another reproducer"
    return leg["traceback"]


@pytest.mark.parametrize("report_id, patch_id", [
    ("accelerate-3866-cpu-of-offloaded-model", "offloaded-move-guard"),
    ("alpaca-lora-368-peft-over-offloaded-base", "peft-offload-redispatch"),
])
def test_explain_names_the_patch_and_the_report(report_id: str, patch_id: str, tmp_path: Path) -> None:
    from metapatch.reports import reports

    done = explain(unpatched_traceback(report_id), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"patch {patch_id}:"), done.stdout  # the best match comes first
    same_mechanism = [r.url for r in reports() if r.patch == patch_id]
    assert any(url in done.stdout for url in same_mechanism), done.stdout
    assert "import metapatch" in done.stdout and "state here:" in done.stdout, done.stdout


def test_explain_open_report_gives_the_workaround(tmp_path: Path) -> None:
    from metapatch.reports import OPEN, reports

    open_reports = [r for r in reports() if r.status == OPEN]
    assert open_reports, "no open report left: pick another case for this test"
    report = open_reports[0]
    done = explain(unpatched_traceback(report.id), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report.url in done.stdout, done.stdout
    assert "not fixed yet" in done.stdout and "Workaround" in done.stdout, done.stdout


def test_explain_no_match(tmp_path: Path) -> None:
    unrelated = subprocess.run([sys.executable, "-c", "import json; json.loads('{')"], capture_output=True, text=True)
    assert "Traceback" in unrelated.stderr
    done = explain(unrelated.stderr, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no match" in done.stdout


def test_explain_reads_stdin(tmp_path: Path) -> None:
    unrelated = subprocess.run([sys.executable, "-c", "import json; json.loads('{')"], capture_output=True, text=True)
    done = subprocess.run([sys.executable, "-m", "metapatch", "explain", "-"], input=unrelated.stderr, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no match" in done.stdout
