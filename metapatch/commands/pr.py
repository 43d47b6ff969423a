"""metapatch pr"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from .pr_body import pr_body
from .pr_series import body_path, branch_name, print_series

HELP = ("prove a patch's upstream diff in an upstream clone (upstream tests before/after, regression tests that "
        "fail on the base and pass with the diff, upstream's ruff config), then commit it on a new branch "
        "with a PR body; refuses when a check fails")

DESCRIPTION = """In a local clone of the upstream repository (a clean work tree): apply the patch's
upstream diff three-way on BASE in a throw-away worktree and commit it with the diff's DEP-3
Description; then, in worktrees of BASE (with only the diff's test files) and of that commit:
  - upstream's own tests of the touched files (tests/test_<module>.py and the diff's test files),
    with the clone's source first on PYTHONPATH and metapatch off;
  - the diff's regression tests: each must fail on BASE and pass with the diff;
  - upstream's linters with upstream's configuration (ruff check, ruff format --check) on the
    changed files: nothing new may appear.
It refuses, listing the failures, when a test that passed on BASE fails with the diff, a regression
test does not fail on BASE or does not pass with it, or the diff adds lint findings. Only then
does it create the branch at the commit, check it out, write the pull-request body (problem,
standalone reproducer, fix, tests with their results) into the clone's git directory, and print
the `gh pr create` command. Nothing is done when the tree is dirty, the clone is not the diff's
project, or the diff does not apply to BASE. --skip-tests / --skip-lint skip the expensive parts.

A series of diffs for the package (<package>-1-<what>.diff, <package>-2-<what>.diff, ...) gives one
branch and pull request per diff, BRANCH-1-<what>, BRANCH-2-<what>, ...: diff N is committed on top
of diff N-1's commit and checked against it (its base), its PR is based on the branch of diff N-1,
and its body says that it depends on that PR. Branches are only created when every diff of the
series passes; the last one is checked out, and a script opens the PRs in order."""


class Refused(Exception):
    """The command will not touch the repository; the message says why and what to do."""


class BadInput(Refused):
    """Refused because of what was asked (no such folder, patch or branch name, not a clone, the wrong one):
    exit code 2, where a refusal of the checks' findings is 1."""


@dataclass
class Prepared:
    branch: str
    base: str
    commit: str
    body_file: Path
    title: str
    command: str
    report: Any = None  # pr_checks.CheckReport, when checks ran
    diff: Any = None
    depends_on: Optional[str] = None  # the branch of the PR this one is based on (a series)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("patch_id", metavar="PATCH_ID")
    parser.add_argument("--repo", required=True, type=Path, help="local clone of the upstream repository")
    parser.add_argument("--base", help="branch to start from (default: main if the clone has it, else the current branch)")
    parser.add_argument("--branch", help="name of the new branch (default: metapatch/PATCH_ID); for a series of diffs, "
                                         "the stem of the branches BRANCH-1-<what>, BRANCH-2-<what>, ...")
    parser.add_argument("--package", help="which of the patch's diffs (or series of diffs), when it has several for "
                                          "different packages (default: the one for this clone)")
    parser.add_argument("--body-file", type=Path, help="where to write the PR body (default: inside the clone's git "
                                                       "directory); for a series, BODY-1.md, BODY-2.md, ...")
    parser.add_argument("--skip-tests", action="store_true",
                        help="do not run upstream's tests nor the regression tests (CI without the upstream stack)")
    parser.add_argument("--skip-lint", action="store_true", help="do not run upstream's linters")
    parser.add_argument("--python", help="interpreter with upstream's test dependencies (default: this one)")
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="extra pytest argument, repeatable (e.g. --pytest-arg=-Wignore::FutureWarning)")
    parser.add_argument("--ruff", help="ruff executable (default: ruff on PATH, else `python -m ruff`)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per pytest run (default 1800)")


def run(args: argparse.Namespace) -> int:
    import sys

    import metapatch
    from metapatch.commands.pr_checks import CheckOptions

    checks = CheckOptions(tests=not args.skip_tests, lint=not args.skip_lint, python=args.python or "",
                          pytest_args=tuple(args.pytest_arg), ruff=args.ruff, timeout=args.timeout)
    try:
        series = prepare(metapatch.registry, args.patch_id, args.repo, base=args.base, branch=args.branch,
                         package=args.package, body_file=args.body_file, checks=checks,
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    except Refused as exc:
        print(f"metapatch pr: refused: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, BadInput) else 1
    skipped = [name for name, flag in (("upstream and regression tests", args.skip_tests), ("linters", args.skip_lint)) if flag]
    if len(series) == 1:
        prepared = series[0]
        if prepared.report is not None:
            print(prepared.report.format())
        if skipped:
            print(f"not checked (skipped on request): {', '.join(skipped)}")
        print(f"created branch {prepared.branch} from {prepared.base} (now checked out) with commit {prepared.commit[:12]}: {prepared.title}")
        print(f"PR body written to {prepared.body_file}")
        print("open the pull request with:")
        print(f"  {prepared.command}")
        return 0
    print_series(series, skipped)
    return 0


# ---------------------------------------------------------------------------------------------
# git


def _git(repo: Path, *args: str, env: Optional[dict] = None, check: bool = True,
         input: Optional[str] = None) -> subprocess.CompletedProcess:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, input=input)
    if check and result.returncode != 0:
        raise Refused(f"`git {' '.join(args)}` failed in {repo}: {(result.stderr or result.stdout).strip()}")
    return result


def _toplevel(repo: Path) -> Path:
    if not repo.is_dir():
        raise BadInput(f"{repo} is not a directory")
    result = _git(repo, "rev-parse", "--show-toplevel", check=False)
    if result.returncode != 0:
        raise BadInput(f"{repo} is not a git repository (clone the upstream project there first)")
    return Path(result.stdout.strip())


def _ensure_clean(repo: Path) -> None:
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        raise Refused(f"the work tree of {repo} has uncommitted changes; commit or stash them first:\n{dirty}")
    for marker in ("MERGE_HEAD", "rebase-merge", "rebase-apply", "CHERRY_PICK_HEAD"):
        path = Path(_git(repo, "rev-parse", "--git-path", marker).stdout.strip())
        if (path if path.is_absolute() else repo / path).exists():
            raise Refused(f"{repo} is in the middle of a merge, rebase or cherry-pick ({marker}); finish it first")


def _resolve_base(repo: Path, base: Optional[str]) -> str:
    if base is None:
        if _git(repo, "rev-parse", "--verify", "--quiet", "refs/heads/main", check=False).returncode == 0:
            return "main"
        current = _git(repo, "symbolic-ref", "--quiet", "--short", "HEAD", check=False).stdout.strip()
        if not current:
            raise Refused(f"{repo} has no main branch and HEAD is detached: pass --base")
        return current
    if _git(repo, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}", check=False).returncode != 0:
        raise BadInput(f"base {base!r} is not a branch or commit of {repo}")
    return base


def _exists_at(repo: Path, base: str, path: str) -> bool:
    return _git(repo, "cat-file", "-e", f"{base}:{path}", check=False).returncode == 0


# ---------------------------------------------------------------------------------------------
# Which diff belongs to this clone


def project_names(repo: Path, base: str) -> List[str]:
    """Distribution names the clone declares at ``base`` (pyproject.toml, setup.cfg, setup.py)."""
    names: List[str] = []
    pyproject = _git(repo, "show", f"{base}:pyproject.toml", check=False)
    if pyproject.returncode == 0:
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            tomllib = None
        if tomllib is not None:
            try:
                name = tomllib.loads(pyproject.stdout).get("project", {}).get("name")
            except tomllib.TOMLDecodeError:
                name = None
            if name:
                names.append(name)
        else:
            match = re.search(r'(?m)^\[project\][^\[]*?^name\s*=\s*["\']([^"\']+)', pyproject.stdout)
            if match:
                names.append(match.group(1))
    setup_cfg = _git(repo, "show", f"{base}:setup.cfg", check=False)
    if setup_cfg.returncode == 0:
        match = re.search(r'(?m)^\[metadata\][^\[]*?^name\s*=\s*(\S+)', setup_cfg.stdout)
        if match:
            names.append(match.group(1))
    setup_py = _git(repo, "show", f"{base}:setup.py", check=False)
    if setup_py.returncode == 0:
        call = setup_py.stdout.find("setup(")
        match = re.search(r'\bname\s*=\s*["\']([^"\']+)["\']', setup_py.stdout[call if call >= 0 else 0:])
        if match:
            names.append(match.group(1))
    return names


def _mismatch(repo: Path, base: str, diff: Any, distribution: str, created: frozenset = frozenset()) -> Optional[str]:
    """Why the clone is not the project the diff is for (None: it is). ``created``: files the diffs
    before this one in its series create."""
    from packaging.utils import canonicalize_name

    missing = [s.path for s in diff.sections
               if not s.creates and s.path not in created and not _exists_at(repo, base, s.path)]
    names = project_names(repo, base)
    wanted = {canonicalize_name(distribution), canonicalize_name(diff.package)}
    reasons = []
    if names and not wanted & {canonicalize_name(n) for n in names}:
        reasons.append(f"it declares the project {', '.join(sorted(set(names)))}, not {distribution}")
    if missing:
        reasons.append(f"{base} has no {', '.join(missing)}")
    return "; ".join(reasons) or None


def choose_series(patch: Any, repo: Path, base: str, package: Optional[str]) -> List[Any]:
    """The patch's diffs for this clone's package, in series order (one diff, or diffs 1..N)."""
    from metapatch import diffs as diffs_mod

    paths = [diffs_mod.resolve_diff_path(rel) for rel in patch.diffs]
    if not paths:
        raise Refused(f"patch {patch.id} has no upstream diff")
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise Refused(f"patch {patch.id} lists diff(s) that do not exist: {', '.join(absent)}")
    candidates = diffs_mod.series_of(diffs_mod.parse(p) for p in paths)
    if package is not None:
        candidates = [series for series in candidates if series[0].package == package]
        if not candidates:
            raise Refused(f"patch {patch.id} has no diff for {package!r} (it has: "
                          f"{', '.join(Path(p).name for p in patch.diffs)})")
    reasons = []
    for series in candidates:
        distribution = _distribution_for(patch, series[0].package)
        created: set = set()
        for diff in series:
            why = _mismatch(repo, base, diff, distribution, frozenset(created))
            if why is not None:
                reasons.append(f"not a clone of {distribution} ({diff.path.name}): {why}")
                break
            created |= {s.path for s in diff.sections if s.creates}
        else:
            problem = diffs_mod.series_problem(series)
            if problem:
                raise Refused(problem)
            return series
    raise BadInput(f"wrong repository {repo}: " + " | ".join(reasons))


def choose_diff(patch: Any, repo: Path, base: str, package: Optional[str]) -> Any:
    """The one diff for this clone (refuses a series: ``choose_series``)."""
    series = choose_series(patch, repo, base, package)
    if len(series) > 1:
        raise Refused(f"patch {patch.id} has a series of {len(series)} diffs for {series[0].package}")
    return series[0]


def _distribution_for(patch: Any, package: str) -> str:
    from packaging.utils import canonicalize_name

    from metapatch.diffs import distribution_of

    for dist in patch.affects:
        if canonicalize_name(dist) == canonicalize_name(package):
            return dist
    return distribution_of(package)


# ---------------------------------------------------------------------------------------------
# Applying and committing


def _apply_in_scratch_index(repo: Path, base: str, diff_file: Path, label: Optional[str] = None) -> None:
    """Apply three-way to a throw-away index holding ``base``: proves the diff applies before the
    user's branch, index or work tree are touched. ``label``: how to name ``base`` (a commit of a
    series) in the refusal."""
    with tempfile.TemporaryDirectory(prefix="metapatch-pr-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git(repo, "read-tree", base, env=env)
        result = _git(repo, "apply", "--cached", "--3way", str(diff_file), env=env, check=False)
        if result.returncode != 0:
            output = "\n".join(line for line in (result.stderr + result.stdout).splitlines()
                               if "lacks the necessary blob" not in line and "Falling back" not in line)
            where = label or base
            raise Refused(f"{diff_file} does not apply to {where} of {repo}, not even three-way; "
                          f"rebase the diff on {where}:\n{output.strip()}")


def prepare(registry: Any, patch_id: str, repo: Path, *, base: Optional[str] = None, branch: Optional[str] = None,
            package: Optional[str] = None, body_file: Optional[Path] = None,
            checks: Optional[Any] = None, progress: Any = None) -> List[Prepared]:
    """Validate, build the commit(s) in throw-away worktrees, run the checks there (``checks``: a
    ``pr_checks.CheckOptions``; None runs none), and only when they pass create the branch(es) at
    those commits, check out the last one and write the PR bodies. One ``Prepared`` per diff: one,
    or one per diff of a series, diff N committed on top of diff N-1 and checked against it. A
    refusal leaves the clone as it was."""
    if patch_id not in registry.patches:
        raise BadInput(f"unknown patch id {patch_id!r}; known: {', '.join(registry.patches) or 'none'}")
    patch = registry.patches[patch_id]
    repo = _toplevel(Path(repo).resolve())
    _ensure_clean(repo)
    base = _resolve_base(repo, base)
    series = choose_series(patch, repo, base, package)
    stem = branch or f"metapatch/{patch_id}"
    branches = [stem] if len(series) == 1 else [branch_name(stem, diff) for diff in series]
    for name in branches:
        if _git(repo, "check-ref-format", "--branch", name, check=False).returncode != 0:
            raise BadInput(f"{name!r} is not a valid branch name")
        if _git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{name}", check=False).returncode == 0:
            raise Refused(f"branch {name} already exists in {repo}; delete it or pass --branch")
    for diff in series:
        if not diff.description[0]:
            raise Refused(f"{diff.path} has no DEP-3 Description to use as the commit message")

    built = []  # (diff, commit, test ids, report)
    with tempfile.TemporaryDirectory(prefix="metapatch-pr-") as tmp:
        start = base
        for n, diff in enumerate(series, 1):
            earlier = "diff 1" if n == 2 else f"diffs 1..{n - 1}"
            label = base if n == 1 else f"{base} with {earlier} of the series (up to {series[n - 2].path.name})"
            _apply_in_scratch_index(repo, start, diff.path, label)
            commit, test_ids, report = _commit_and_check(repo, start, label, diff, checks, Path(tmp) / str(n), progress)
            built.append((diff, commit, test_ids, report))
            start = commit

    for name, (_, commit, _, _) in zip(branches, built):
        _git(repo, "branch", name, commit)
    _git(repo, "switch", "--quiet", branches[-1])
    git_dir = Path(_git(repo, "rev-parse", "--absolute-git-dir").stdout.strip())
    prepared = []
    for n, (name, (diff, commit, test_ids, report)) in enumerate(zip(branches, built), 1):
        on = base if n == 1 else branches[n - 2]
        target = body_path(git_dir, patch_id, body_file, n if len(series) > 1 else None)
        target.parent.mkdir(parents=True, exist_ok=True)
        position = (n, len(series), branches[n - 2] if n > 1 else None) if len(series) > 1 else None
        target.write_text(pr_body(patch, diff, test_ids=test_ids, report=report, series=position))
        subject, _ = diff.description
        command = " ".join(shlex.quote(part) for part in (
            "gh", "pr", "create", "--base", on, "--head", name, "--title", subject, "--body-file", str(target)))
        prepared.append(Prepared(name, on, commit, target, subject, f"cd {shlex.quote(str(repo))} && {command}", report,
                                 diff, branches[n - 2] if n > 1 else None))
    return prepared


def _commit_and_check(repo: Path, start: str, label: str, diff: Any, checks: Optional[Any], scratch: Path,
                      progress: Any) -> "tuple[str, List[str], Any]":
    """Commit ``diff`` on ``start`` in a throw-away worktree and run the checks against ``start``
    (the base, or the previous diff's commit). Returns (commit, regression test ids, report)."""
    from metapatch.commands import pr_checks

    report = None
    scratch.mkdir(parents=True)
    with _worktree(repo, start, scratch / "with") as with_tree:
        _git(with_tree, "apply", "--3way", "--index", str(diff.path))
        _git(with_tree, "commit", "--quiet", "--no-verify", "--file", "-", input=commit_message(diff))
        commit = _git(with_tree, "rev-parse", "HEAD").stdout.strip()
        test_ids = pr_checks.test_ids(with_tree, diff)
        if checks is not None and (checks.tests or checks.lint):
            if progress:
                progress(f"checking {diff.path.name} on {label} and with the diff (upstream tests, linters)...")
            with _worktree(repo, start, scratch / "base") as base_tree:
                tests_only = [s.path for s in diff.other_sections()]

                def add_tests_to_base() -> None:
                    _git(base_tree, "apply", "--3way", "--index", *(f"--include={p}" for p in tests_only),
                         str(diff.path))

                report = pr_checks.run_checks(base_tree, with_tree, diff, checks, scratch, add_tests_to_base)
            if not report.ok:
                raise Refused(f"{diff.path.name} is not ready for {label}:\n{report.format()}")
    return commit, test_ids, report


@contextlib.contextmanager
def _worktree(repo: Path, base: str, where: Path):
    """A detached worktree of ``base``; removed (with its administrative files) afterwards."""
    _git(repo, "worktree", "add", "--quiet", "--detach", str(where), base)
    try:
        yield where
    finally:
        _git(repo, "worktree", "remove", "--force", str(where), check=False)
        _git(repo, "worktree", "prune", check=False)


def commit_message(diff: Any) -> str:
    subject, body = diff.description
    return subject + ("\n\n" + body if body else "") + "\n"
