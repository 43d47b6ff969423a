"""What `metapatch pr` runs before it prints `gh pr create`: upstream's tests of the
touched files on the base and with the diff, the regression tests (fail on the base, pass with the
diff), and upstream's ruff configuration. On a tiny local git repository (real git, real pytest,
real ruff), and on a real accelerate clone when /work/.mirror has one."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import metapatch
from metapatch import Patch, Target
from metapatch._framework.registry import Registry
from metapatch.cli import main as cli_main
from metapatch.commands import pr_checks

ROOT = Path(__file__).resolve().parents[1]
PATCH_ID = "mp-tiny-fix"
BRANCH = f"metapatch/{PATCH_ID}"
GIT_ENV = {"GIT_AUTHOR_NAME": "metapatch tests", "GIT_AUTHOR_EMAIL": "tests@metapatch.invalid",
           "GIT_COMMITTER_NAME": "metapatch tests", "GIT_COMMITTER_EMAIL": "tests@metapatch.invalid",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
CORE = "src/mptiny/core.py"
TESTS = "tests/test_core.py"
CORE_SOURCE = "def scale(x):\n    return x * 2\n\n\ndef add(a, b):\n    return a + b\n"  # scale should triple
TESTS_SOURCE = ("from mptiny.core import add, scale\n\n\ndef test_add():\n    assert add(1, 2) == 3\n\n\n"
                "class TestScale:\n    def test_scale_zero(self):\n        assert scale(0) == 0\n")
REGRESSION = "\n    def test_scale_triples(self):\n        assert scale(1) == 3\n"
HEADER = ("Description: scale() triples\n The documented factor is three.\n"
          "Origin: metapatch\nBug: https://github.com/example/mptiny/issues?q=scale\nForwarded: no\n"
          "Applied-Upstream: no\nLast-Update: 2026-11-30\n---\n")


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env={**os.environ, **GIT_ENV})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def unified(path: str, old: str, new: str) -> str:
    body = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n" + body


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A git repository of the project ``mptiny`` (src layout, pytest tests, ruff configured), and
    a registered patch whose diff the test writes."""
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    repo = tmp_path / "mptiny"
    (repo / "src" / "mptiny").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "src" / "mptiny" / "__init__.py").write_text("")
    (repo / CORE).write_text(CORE_SOURCE)
    (repo / TESTS).write_text(TESTS_SOURCE)
    (repo / "pyproject.toml").write_text('[project]\nname = "mptiny"\nversion = "1.0"\n\n'
                                         '[tool.ruff]\nline-length = 119\n\n[tool.ruff.lint]\nselect = ["E", "F"]\n')
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "mptiny")
    root = tmp_path / "upstream_diffs"
    monkeypatch.setenv("METAPATCH_DIFFS_ROOT", str(root))
    patch = Patch(id=PATCH_ID, title="tiny fix", affects={"mptiny": ">=0"},
                  targets=(Target("mp_never_imported.core", "scale", fingerprints=("0" * 16,),
                                  wrapper=lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)),),
                  diffs=(f"upstream_diffs/{PATCH_ID}/mptiny.diff",))
    monkeypatch.setattr(metapatch, "registry", Registry([patch]))

    def write(core: str, tests: str, reproducer: str = "") -> None:
        folder = root / PATCH_ID
        folder.mkdir(parents=True, exist_ok=True)
        text = HEADER + unified(CORE, CORE_SOURCE, core) if core != CORE_SOURCE else HEADER
        (folder / "mptiny.diff").write_text(text + (unified(TESTS, TESTS_SOURCE, tests) if tests != TESTS_SOURCE else ""))
        if reproducer:
            (folder / "reproducer.py").write_text(reproducer)
    return repo, write


def state(repo: Path):
    return (git(repo, "rev-parse", "HEAD"), git(repo, "branch", "--list", "--format=%(refname:short)"),
            git(repo, "status", "--porcelain"), git(repo, "worktree", "list", "--porcelain").count("worktree "))


def run_pr(capsys, repo: Path, *extra: str):
    code = cli_main(["pr", PATCH_ID, "--repo", str(repo), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def ruff_or_skip() -> str:
    found = os.environ.get("METAPATCH_TEST_RUFF") or shutil.which("ruff")
    if not found:
        pytest.skip("ruff is not installed (set METAPATCH_TEST_RUFF=/path/to/ruff)")
    return found


FIXED = CORE_SOURCE.replace("x * 2", "x * 3")


def test_pr_runs_the_tests_and_accepts_a_sound_diff(tiny, capsys):
    repo, write = tiny
    reproducer = '"""scale() doubles.\n\nFails with: AssertionError\n"""\nfrom mptiny.core import scale\n\nassert scale(1) == 3\n'
    write(FIXED, TESTS_SOURCE + REGRESSION, reproducer)
    code, out, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 0, err
    regression = f"{TESTS}::TestScale::test_scale_triples"
    assert f"{regression}: base failed, with the diff passed" in out
    # upstream's file as it is on the base, and with the diff (which adds the regression test)
    assert "base: 2 passed, 0 failed, 0 skipped; with the diff: 3 passed, 0 failed, 0 skipped" in out
    assert "gh pr create" in out and git(repo, "symbolic-ref", "--short", "HEAD") == BRANCH
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1  # scratch worktrees removed
    body = (Path(git(repo, "rev-parse", "--absolute-git-dir")) / "metapatch" / f"{PATCH_ID}-pr-body.md").read_text()
    assert f"- `{regression}`" in body  # with its class: pytest resolves it
    assert "```python\n" + reproducer.rstrip() + "\n```" in body  # the reproducer, whole
    assert "fails with `AssertionError`" in body
    assert "No issue filed." in body and "issues?q=" not in body  # a search URL is not an issue
    # The id in the body is one pytest collects in the clone.
    collected = subprocess.run([os.sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                regression], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo / "src")},
                               capture_output=True, text=True)
    assert collected.returncode == 0 and regression in collected.stdout, collected.stdout + collected.stderr


def test_pr_refuses_a_diff_that_breaks_a_passing_upstream_test(tiny, capsys):
    repo, write = tiny
    write(FIXED.replace("a + b", "a - b"), TESTS_SOURCE + REGRESSION)
    before = state(repo)
    code, out, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 1 and "gh pr create" not in out
    assert "pass on the base and fail with the diff: tests/test_core.py::test_add" in err
    assert state(repo) == before  # no branch, no worktree left behind


def test_pr_refuses_a_regression_test_that_passes_on_the_base(tiny, capsys):
    repo, write = tiny
    write(FIXED, TESTS_SOURCE + "\n    def test_scale_of_zero_again(self):\n        assert scale(0) == 0\n")
    before = state(repo)
    code, _, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 1 and "no regression test fails on the base: none of them shows the bug" in err
    assert "test_scale_of_zero_again passes on the base too" in err
    assert state(repo) == before
    # Next to one that shows the bug, a test that pins kept behaviour is fine.
    write(FIXED, TESTS_SOURCE + REGRESSION + "\n    def test_scale_of_zero_again(self):\n        assert scale(0) == 0\n")
    code, out, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 0, err
    assert "TestScale::test_scale_of_zero_again: base passed, with the diff passed" in out
    assert "TestScale::test_scale_triples: base failed, with the diff passed" in out


def test_pr_refuses_a_diff_without_regression_test_and_a_fix_that_does_not_fix(tiny, capsys):
    repo, write = tiny
    write(FIXED, TESTS_SOURCE)
    code, _, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 1 and "adds no regression test" in err
    write(CORE_SOURCE.replace("a + b", "b + a"), TESTS_SOURCE + REGRESSION)
    code, _, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 1 and "failed with the diff: the diff does not fix what it tests" in err


def test_pr_refuses_what_upstream_ruff_configuration_rejects(tiny, capsys):
    ruff = ruff_or_skip()
    repo, write = tiny
    write(CORE_SOURCE.replace("x * 2", "x*3").replace("def add", "import os\n\n\ndef add"), TESTS_SOURCE + REGRESSION)
    before = state(repo)
    code, out, err = run_pr(capsys, repo, "--skip-tests", "--ruff", ruff)
    assert code == 1 and "gh pr create" not in out
    assert "`ruff format --check` (upstream's configuration) would reformat: src/mptiny/core.py" in err
    assert "F401" in err  # the unused import: upstream selects the F rules
    assert state(repo) == before
    write(FIXED, TESTS_SOURCE + REGRESSION)
    code, out, err = run_pr(capsys, repo, "--skip-tests", "--ruff", ruff)
    assert code == 0, err
    assert "check: 0 finding(s) (0 new); format --check: 0 file(s) to reformat (0 new)" in out


def test_lint_without_ruff_refuses_unless_skipped(tiny, capsys, monkeypatch):
    repo, write = tiny
    write(FIXED, TESTS_SOURCE + REGRESSION)
    monkeypatch.setattr(pr_checks, "ruff_command", lambda options: None)
    code, _, err = run_pr(capsys, repo, "--skip-tests")
    assert code == 1 and "which is not installed" in err and "--skip-lint" in err
    code, out, _ = run_pr(capsys, repo, "--skip-tests", "--skip-lint")
    assert code == 0 and "not checked (skipped on request): upstream and regression tests, linters" in out


def test_pinned_ruff_is_read_from_upstream_files(tmp_path):
    (tmp_path / "setup.py").write_text('extras["quality"] = ["ruff == 0.13.1"]\n')
    assert pr_checks.pinned_ruff(tmp_path) == "0.13.1"
    (tmp_path / "setup.py").unlink()
    (tmp_path / ".pre-commit-config.yaml").write_text("repos:\n  - repo: https://github.com/astral-sh/ruff-pre-commit\n    rev: v0.14.3\n")
    assert pr_checks.pinned_ruff(tmp_path) == "0.14.3"


ACCELERATE_MIRROR = Path("/work/.mirror/huggingface+accelerate/repo")


@pytest.mark.skipif(not ACCELERATE_MIRROR.is_dir(), reason="no accelerate mirror in /work/.mirror (fetch github:huggingface/accelerate)")
def test_pr_on_a_real_accelerate_clone(tmp_path, capsys, monkeypatch):
    """accelerate-emptiness-probe on accelerate's main: upstream's tests/test_hooks.py on both sides,
    its regression test failing on main and passing with the diff."""
    pytest.importorskip("accelerate")
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("METAPATCH_DIFFS_ROOT", raising=False)
    clone = tmp_path / "accelerate"
    subprocess.run(["git", "clone", "-q", "--shared", "-b", "main", str(ACCELERATE_MIRROR), str(clone)], check=True)
    ruff = os.environ.get("METAPATCH_TEST_RUFF") or shutil.which("ruff")
    lint = ["--ruff", ruff] if ruff else ["--skip-lint"]
    code = cli_main(["pr", "accelerate-emptiness-probe", "--repo", str(clone), *lint])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert ("tests/test_hooks.py::HooksModelTester::test_attach_execution_device_hook_does_not_serialize_modules: "
            "base failed, with the diff passed") in out


# ---------------------------------------------------------------------------------------------
# A series of diffs: one branch and pull request per diff, diff N based on diff N-1

SCALED = FIXED.replace("def scale(x):\n    return x * 3\n", "def scale(x, factor=3):\n    return x * factor\n")
REGRESSION_2 = "\n    def test_scale_takes_a_factor(self):\n        assert scale(1, factor=4) == 4\n"


def register_series(root: Path, monkeypatch, second_core: str = SCALED) -> None:
    """mptiny-1-triple.diff (scale triples) and mptiny-2-factor.diff (on top of it: a factor
    argument), each with its regression test in tests/test_core.py."""
    folder = root / PATCH_ID
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.diff"):
        old.unlink()
    header_2 = HEADER.replace("Description: scale() triples\n The documented factor is three.\n",
                              "Description: scale() takes a factor\n Three stays the default.\n")
    (folder / "mptiny-1-triple.diff").write_text(
        HEADER + unified(CORE, CORE_SOURCE, FIXED) + unified(TESTS, TESTS_SOURCE, TESTS_SOURCE + REGRESSION))
    (folder / "mptiny-2-factor.diff").write_text(
        header_2 + unified(CORE, FIXED, second_core)
        + unified(TESTS, TESTS_SOURCE + REGRESSION, TESTS_SOURCE + REGRESSION + REGRESSION_2))
    (folder / "reproducer-2.py").write_text('"""scale() has no factor.\n\nFails with: TypeError\n"""\n'
                                            "from mptiny.core import scale\n\nscale(1, factor=4)\n")
    patch = Patch(id=PATCH_ID, title="tiny fix", affects={"mptiny": ">=0"},
                  targets=(Target("mp_never_imported.core", "scale", fingerprints=("0" * 16,),
                                  wrapper=lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)),),
                  diffs=(f"upstream_diffs/{PATCH_ID}/mptiny-1-triple.diff", f"upstream_diffs/{PATCH_ID}/mptiny-2-factor.diff"))
    monkeypatch.setattr(metapatch, "registry", Registry([patch]))


def test_pr_makes_one_branch_per_diff_of_a_series_each_checked_on_the_one_before(tiny, capsys, monkeypatch, tmp_path):
    repo, _ = tiny
    register_series(tmp_path / "upstream_diffs", monkeypatch)
    code, out, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 0, err
    first, second = f"{BRANCH}-1-triple", f"{BRANCH}-2-factor"
    # Each diff's regression test fails on its own base (diff 2's base is diff 1's commit) and passes with it.
    assert f"{TESTS}::TestScale::test_scale_triples: base failed, with the diff passed" in out
    assert f"{TESTS}::TestScale::test_scale_takes_a_factor: base failed, with the diff passed" in out
    # diff 2's upstream run includes diff 1's test, on both sides
    assert "base: 3 passed, 0 failed, 0 skipped; with the diff: 4 passed, 0 failed, 0 skipped" in out
    assert git(repo, "rev-parse", f"{second}^") == git(repo, "rev-parse", first)
    assert git(repo, "rev-parse", f"{first}^") == git(repo, "rev-parse", "main")
    assert git(repo, "symbolic-ref", "--short", "HEAD") == second
    assert git(repo, "log", "-1", "--format=%s", first) == "scale() triples"
    assert git(repo, "log", "-1", "--format=%s", second) == "scale() takes a factor"
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("cd ") and "gh pr create" in line]
    assert len(commands) == 2
    assert f"--base main --head {first}" in commands[0] and f"--base {first} --head {second}" in commands[1]
    git_dir = Path(git(repo, "rev-parse", "--absolute-git-dir")) / "metapatch"
    body_1, body_2 = ((git_dir / f"{PATCH_ID}-{n}-pr-body.md").read_text() for n in (1, 2))
    assert "Part 1 of 2" in body_1 and "#DEPENDS_ON" not in body_1
    assert f"Part 2 of 2 of a series of pull requests, each fixing one problem. Depends on #DEPENDS_ON (branch `{first}`)" in body_2
    assert "Fails with: TypeError" in body_2 and "scale(1, factor=4)" in body_2  # its own reproducer-2.py
    assert f"- `{TESTS}::TestScale::test_scale_takes_a_factor`" in body_2 and "test_scale_triples`" not in body_2
    script = (git_dir / f"{PATCH_ID}-create-prs.sh").read_text()
    assert script.index(f"--head {first}") < script.index("#DEPENDS_ON|#$number") < script.index(f"--head {second}")
    # The script fills in the number of the PR before: run it with a fake `gh` that prints a PR URL.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "gh").write_text("#!/bin/sh\necho https://github.com/example/mptiny/pull/41\n")
    (fake_bin / "gh").chmod(0o755)
    subprocess.run(["sh", str(git_dir / f"{PATCH_ID}-create-prs.sh")], check=True, capture_output=True,
                   env={**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"})
    assert f"Depends on #41 (branch `{first}`)" in (git_dir / f"{PATCH_ID}-2-pr-body.md").read_text()


def test_pr_refuses_a_series_whose_later_diff_fails_and_creates_no_branch(tiny, capsys, monkeypatch, tmp_path):
    repo, _ = tiny
    register_series(tmp_path / "upstream_diffs", monkeypatch, second_core=SCALED.replace("a + b", "a - b"))
    before = state(repo)
    code, out, err = run_pr(capsys, repo, "--skip-lint")
    assert code == 1 and "gh pr create" not in out
    assert "mptiny-2-factor.diff is not ready for main with diff 1 of the series (up to mptiny-1-triple.diff)" in err
    assert "pass on the base and fail with the diff: tests/test_core.py::test_add" in err
    assert state(repo) == before  # not even diff 1's branch: the series goes up whole or not at all
