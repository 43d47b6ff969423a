"""`metapatch explain` on real tracebacks: corpus reproducers run without metapatch (METAPATCH_DISABLE=all) on
the installed stack, and the user flows of tests/explain/flows (saved by tests/explain/capture.py, run the
same way), fed to the command."""

from __future__ import annotations

import json
import os
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
    first = next(line for line in done.stdout.splitlines() if line.startswith("1. patch "))
    assert first.startswith(f"1. patch {patch_id} (most likely)"), done.stdout  # the best match comes first
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


# -- ranking on user flows ------------------------------------------------------------------------------

TRACEBACKS = REPO / "tests" / "explain" / "tracebacks"
# flow -> the patch that fixes it (each flow passes with metapatch: `metapatch run tests/explain/flows/<flow>.py`)
FIRST = {
    "inputs_to_model_device": "offloaded-model-device",  # model(ids.to(model.device)), the embedding on disk
    "generate_to_model_device": "offloaded-model-device",
    "tied_map_split": "tied-device-map-transformers",  # an explicit map splitting a tied pair
    "to_float16": "offloaded-dtype-conversion",  # model.to(torch.float16)
    "submodule_to_cpu": "offloaded-move-guard",
    "resize_offloaded_embeddings": "offloaded-resize-token-embeddings",
    "tied_init_empty_dispatch": "accelerate-tie-before-load",
}


def test_every_saved_traceback_has_an_expected_patch() -> None:
    assert sorted(p.stem for p in TRACEBACKS.glob("*.txt")) == sorted(FIRST)


@pytest.mark.parametrize("flow", sorted(FIRST))
def test_the_fixing_patch_ranks_first_with_its_evidence(flow: str) -> None:
    from metapatch.commands import explain as command

    found = command.match((TRACEBACKS / f"{flow}.txt").read_text())
    candidates = found["candidates"]
    shown = [(c.patch, c.score, c.reasons) for c in candidates]
    scores = [c.score for c in candidates]
    assert scores == sorted(scores, reverse=True)
    top = [c for c in candidates if c.score == scores[0]]
    assert FIRST[flow] in [c.patch for c in top], shown
    first = next(c for c in top if c.patch == FIRST[flow])
    assert first.reasons and all(isinstance(r, str) and r for r in first.reasons)
    if len(top) > 1:
        # A tie only between patches whose reproducers fail with this very error on the installed versions
        # (accelerate 1.15 has a second bug that raises the tied split's KeyError): the error alone cannot tell them
        # apart, and the command shows both first.
        here = "fails with this error on the installed versions"
        assert all(any(here in reason for reason in c.reasons) for c in top), shown


def test_a_report_matched_only_by_the_hook_around_every_offloaded_forward_is_not_shown() -> None:
    """accelerate's ``pre_forward``/``new_forward`` are on every offloaded forward's traceback: a corpus report must
    match by its error text or by a frame that says something (the textual inversion report, whose patch replaces
    ``pre_forward``, was shown for the tied split's KeyError and ranked its patch first on accelerate 1.15)."""
    from metapatch.commands import explain as command

    found = command.match((TRACEBACKS / "tied_map_split.txt").read_text())
    assert "diffusers-3922-textual-inversion-sequential-offload" not in [r.id for r in found["reports"]]
    assert found["reports"], "the tied split still has its report (by its error text)"


def test_json_output_ranks_candidates_with_reasons_and_evidence(tmp_path: Path) -> None:
    done = _cli("explain", str(TRACEBACKS / "to_float16.txt"), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["match"] is True and data["error_type"] == "RuntimeError"
    assert data["user_line"]["source"] == "model = model.to(torch.float16)"
    assert [c["rank"] for c in data["candidates"]] == list(range(1, len(data["candidates"]) + 1))
    top = data["candidates"][0]
    assert top["patch"] == "offloaded-dtype-conversion" and top["state"] and top["reasons"]
    assert any("converts the model's dtype" in reason for reason in top["reasons"])


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metapatch", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "nope.txt", "nope.txt: no such file"),
    (lambda tmp: tmp, "is a folder"),
    (lambda tmp: (tmp / "empty.txt", (tmp / "empty.txt").write_text("  \n"))[0], "is empty"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, make, message: str) -> None:
    done = _cli("explain", str(make(tmp_path)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_a_terminal_on_stdin_is_never_waited_on_silently() -> None:
    import pty

    controller, terminal = pty.openpty()
    try:
        done = _cli("explain", stdin=terminal)
    finally:
        os.close(terminal)
        os.close(controller)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no traceback given" in done.stderr and "metapatch explain -" in done.stderr


def test_a_closed_output_pipe_is_no_traceback() -> None:
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before anything is written (`| head -1` once it has its line)
    try:
        done = subprocess.run([sys.executable, "-m", "metapatch", "explain", str(TRACEBACKS / "to_float16.txt")],
                              cwd=REPO, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)
    assert done.returncode == 141 and "Error" not in done.stderr, done.stderr
