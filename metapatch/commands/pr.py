"""metapatch pr"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

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
project, or the diff does not apply to BASE. --skip-tests / --skip-lint skip the expensive parts."""


class Refused(Exception):
    """The command will not touch the repository; the message says why and what to do."""


@dataclass
class Prepared:
    branch: str
    base: str
    commit: str
    body_file: Path
    title: str
    command: str
    report: Any = None  # pr_checks.CheckReport, when checks ran


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("patch_id", metavar="PATCH_ID")
    parser.add_argument("--repo", required=True, type=Path, help="local clone of the upstream repository")
    parser.add_argument("--base", help="branch to start from (default: main if the clone has it, else the current branch)")
    parser.add_argument("--branch", help="name of the new branch (default: metapatch/PATCH_ID)")
    parser.add_argument("--package", help="which of the patch's diffs, when it has several (default: the one for this clone)")
    parser.add_argument("--body-file", type=Path, help="where to write the PR body (default: inside the clone's git directory)")
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
        prepared = prepare(metapatch.registry, args.patch_id, args.repo, base=args.base, branch=args.branch,
                           package=args.package, body_file=args.body_file, checks=checks,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except Refused as exc:
        print(f"metapatch pr: refused: {exc}", file=sys.stderr)
        return 1
    if prepared.report is not None:
        print(prepared.report.format())
    skipped = [name for name, flag in (("upstream and regression tests", args.skip_tests), ("linters", args.skip_lint)) if flag]
    if skipped:
        print(f"not checked (skipped on request): {', '.join(skipped)}")
    print(f"created branch {prepared.branch} from {prepared.base} (now checked out) with commit {prepared.commit[:12]}: {prepared.title}")
    print(f"PR body written to {prepared.body_file}")
    print("open the pull request with:")
    print(f"  {prepared.command}")
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
        raise Refused(f"{repo} is not a directory")
    result = _git(repo, "rev-parse", "--show-toplevel", check=False)
    if result.returncode != 0:
        raise Refused(f"{repo} is not a git repository (clone the upstream project there first)")
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
        raise Refused(f"base {base!r} is not a branch or commit of {repo}")
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


def _mismatch(repo: Path, base: str, diff: Any, distribution: str) -> Optional[str]:
    """Why the clone is not the project the diff is for (None: it is)."""
    from packaging.utils import canonicalize_name

    missing = [s.path for s in diff.sections if not s.creates and not _exists_at(repo, base, s.path)]
    names = project_names(repo, base)
    wanted = {canonicalize_name(distribution), canonicalize_name(diff.package)}
    reasons = []
    if names and not wanted & {canonicalize_name(n) for n in names}:
        reasons.append(f"it declares the project {', '.join(sorted(set(names)))}, not {distribution}")
    if missing:
        reasons.append(f"{base} has no {', '.join(missing)}")
    return "; ".join(reasons) or None


def choose_diff(patch: Any, repo: Path, base: str, package: Optional[str]) -> Any:
    from metapatch import diffs as diffs_mod

    paths = [diffs_mod.resolve_diff_path(rel) for rel in patch.diffs]
    if not paths:
        raise Refused(f"patch {patch.id} has no upstream diff")
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise Refused(f"patch {patch.id} lists diff(s) that do not exist: {', '.join(absent)}")
    candidates = [diffs_mod.parse(p) for p in paths]
    if package is not None:
        candidates = [d for d in candidates if d.package == package]
        if not candidates:
            raise Refused(f"patch {patch.id} has no diff for {package!r} (it has: "
                          f"{', '.join(Path(p).stem for p in patch.diffs)})")
    reasons = []
    for diff in candidates:
        distribution = _distribution_for(patch, diff.package)
        why = _mismatch(repo, base, diff, distribution)
        if why is None:
            return diff
        reasons.append(f"not a clone of {distribution} ({diff.path.name}): {why}")
    raise Refused(f"wrong repository {repo}: " + " | ".join(reasons))


def _distribution_for(patch: Any, package: str) -> str:
    from packaging.utils import canonicalize_name

    from metapatch.diffs import distribution_of

    for dist in patch.affects:
        if canonicalize_name(dist) == canonicalize_name(package):
            return dist
    return distribution_of(package)


# ---------------------------------------------------------------------------------------------
# Applying and committing


def _apply_in_scratch_index(repo: Path, base: str, diff_file: Path) -> None:
    """Apply three-way to a throw-away index holding ``base``: proves the diff applies before the
    user's branch, index or work tree are touched."""
    with tempfile.TemporaryDirectory(prefix="metapatch-pr-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git(repo, "read-tree", base, env=env)
        result = _git(repo, "apply", "--cached", "--3way", str(diff_file), env=env, check=False)
        if result.returncode != 0:
            output = "\n".join(line for line in (result.stderr + result.stdout).splitlines()
                               if "lacks the necessary blob" not in line and "Falling back" not in line)
            raise Refused(f"{diff_file} does not apply to {base} of {repo}, not even three-way; "
                          f"rebase the diff on {base}:\n{output.strip()}")


def prepare(registry: Any, patch_id: str, repo: Path, *, base: Optional[str] = None, branch: Optional[str] = None,
            package: Optional[str] = None, body_file: Optional[Path] = None,
            checks: Optional[Any] = None, progress: Any = None) -> Prepared:
    """Validate, build the commit in a throw-away worktree, run the checks there (``checks``: a
    ``pr_checks.CheckOptions``; None runs none), and only when they pass create ``branch`` at that
    commit, check it out and write the PR body. A refusal leaves the clone as it was."""
    from metapatch.commands import pr_checks

    if patch_id not in registry.patches:
        raise Refused(f"unknown patch id {patch_id!r}; known: {', '.join(registry.patches) or 'none'}")
    patch = registry.patches[patch_id]
    repo = _toplevel(Path(repo).resolve())
    _ensure_clean(repo)
    base = _resolve_base(repo, base)
    diff = choose_diff(patch, repo, base, package)
    branch = branch or f"metapatch/{patch_id}"
    if _git(repo, "check-ref-format", "--branch", branch, check=False).returncode != 0:
        raise Refused(f"{branch!r} is not a valid branch name")
    if _git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False).returncode == 0:
        raise Refused(f"branch {branch} already exists in {repo}; delete it or pass --branch")
    subject, _ = diff.description
    if not subject:
        raise Refused(f"{diff.path} has no DEP-3 Description to use as the commit message")
    _apply_in_scratch_index(repo, base, diff.path)

    report = None
    with tempfile.TemporaryDirectory(prefix="metapatch-pr-") as tmp:
        scratch = Path(tmp)
        with _worktree(repo, base, scratch / "with") as with_tree:
            _git(with_tree, "apply", "--3way", "--index", str(diff.path))
            _git(with_tree, "commit", "--quiet", "--no-verify", "--file", "-", input=commit_message(diff))
            commit = _git(with_tree, "rev-parse", "HEAD").stdout.strip()
            test_ids = pr_checks.test_ids(with_tree, diff)
            if checks is not None and (checks.tests or checks.lint):
                if progress:
                    progress(f"checking {diff.path.name} on {base} and with the diff (upstream tests, linters)...")
                with _worktree(repo, base, scratch / "base") as base_tree:
                    tests_only = [s.path for s in diff.other_sections()]

                    def add_tests_to_base() -> None:
                        _git(base_tree, "apply", "--3way", "--index", *(f"--include={p}" for p in tests_only),
                             str(diff.path))

                    report = pr_checks.run_checks(base_tree, with_tree, diff, checks, scratch, add_tests_to_base)
                if not report.ok:
                    raise Refused(f"{diff.path.name} is not ready for {base}:\n{report.format()}")
    _git(repo, "switch", "--quiet", "--create", branch, commit)
    git_dir = Path(_git(repo, "rev-parse", "--absolute-git-dir").stdout.strip())
    target = Path(body_file) if body_file else git_dir / "metapatch" / f"{patch_id}-pr-body.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(pr_body(patch, diff, test_ids=test_ids, report=report))
    command = " ".join(shlex.quote(part) for part in (
        "gh", "pr", "create", "--base", base, "--head", branch, "--title", subject, "--body-file", str(target)))
    return Prepared(branch, base, commit, target, subject, f"cd {shlex.quote(str(repo))} && {command}", report)


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


# ---------------------------------------------------------------------------------------------
# The pull-request body


def reproducer_source(patch: Any) -> str:
    """A self-contained reproducer: the patch's main selftest scenario function with the module
    helpers, constants and imports it uses (relative imports made absolute)."""
    return _reproducer(patch)[0]


def _reproducer(patch: Any) -> "tuple[str, List[dict]]":
    """(source of the main scenario, every scenario of the patch as a dict)."""
    if not patch.selftest:
        return "", []
    scenarios = _declared_scenarios(patch)
    if not scenarios:
        return "", []
    # The main one: what users run in `metapatch selftest` and what fails upstream.
    main = next((s for s in scenarios if s["expected_error"] and s["in_selftest"]), scenarios[0])
    source = _module_source(main["module"])
    if source is None:
        return "", scenarios
    try:
        return _closure_source(source, main["module"], main["function"]), scenarios
    except (SyntaxError, KeyError):
        return "", scenarios


def _declared_scenarios(patch: Any) -> List[dict]:
    """The patch's scenarios from ``SCENARIOS`` in the module ``Patch.selftest`` names. Importing a
    selftest module is cheap by convention (torch is imported inside the scenario functions)."""
    import importlib

    try:
        module = importlib.import_module(patch.selftest)
    except Exception:  # a broken reproducer module must not stop the PR; the body says so
        return []
    found = []
    for scenario in getattr(module, "SCENARIOS", ()):
        if getattr(scenario, "patch_id", None) != patch.id:
            continue
        module_name, _, function = scenario.function.partition(":")
        found.append({"name": scenario.name, "module": module_name, "function": function,
                      "description": scenario.description, "expected_error": scenario.expected_error,
                      "in_selftest": scenario.in_selftest})
    return found


def _module_source(module_name: str) -> Optional[str]:
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    return Path(spec.origin).read_text()


def _top_level_names(node: ast.stmt) -> List[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _closure_source(source: str, module_name: str, function: str) -> str:
    """``function`` and every top-level definition of its module it needs, in source order, after
    the imports they use."""
    tree = ast.parse(source)
    definitions = {name: node for node in tree.body for name in _top_level_names(node)}
    imported = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                imported[(alias.asname or alias.name).split(".")[0]] = (node, alias)
    needed, used, queue = set(), set(), [function]
    definitions[function]  # KeyError: the scenario names a function the module does not define
    while queue:
        name = queue.pop()
        if name in used:
            continue
        used.add(name)
        node = definitions.get(name)
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            queue += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    package = module_name.rpartition(".")[0]
    plain: List[str] = []
    from_imports: dict = {}  # module -> names, in the source's order
    for name in sorted(used & set(imported), key=lambda n: (imported[n][0].lineno, n)):
        node, alias = imported[name]
        spelled = alias.name + (f" as {alias.asname}" if alias.asname else "")
        if isinstance(node, ast.Import):
            plain.append(f"import {spelled}")
            continue
        base = node.module or ""
        if node.level:  # relative to the selftest package: absolute, so the snippet runs anywhere
            parts = package.split(".")
            anchor = ".".join(parts[:len(parts) - (node.level - 1)])
            base = f"{anchor}.{base}" if base else anchor
        from_imports.setdefault(base, []).append(spelled)
    imports = plain + [f"from {base} import {', '.join(names)}" for base, names in from_imports.items()]
    lines = source.splitlines()
    blocks = []
    for node in tree.body:
        if id(node) in needed:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            blocks.append("\n".join(lines[first - 1:node.end_lineno]))
    return "\n".join(imports) + ("\n\n\n" if imports else "") + "\n\n\n".join(blocks)


def standalone_reproducer(diff: Any) -> Optional[Path]:
    """``upstream_diffs/<id>/<diff stem>.reproducer.py`` or ``reproducer.py``: one short file that
    needs only the upstream packages and fails on the base."""
    for name in (f"{diff.path.stem}.reproducer.py", "reproducer.py"):
        path = diff.path.parent / name
        if path.is_file():
            return path
    return None


def reproducer_fields(source: str) -> dict:
    """``Scenario:`` and ``Fails with:`` lines of a reproducer's docstring."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    fields = {}
    for key in ("Scenario", "Fails with", "Affected"):
        match = re.search(rf"(?m)^{key}:\s*(.+)$", doc)
        if match:
            fields[key] = match.group(1).strip()
    return fields


def _repository_of(diff: Any) -> Optional[str]:
    from metapatch.commands.pr_checks import REPOSITORIES

    return REPOSITORIES.get(diff.package)


def issue_links(patch: Any, diff: Any) -> "tuple[List[str], List[str]]":
    """(links to a filed issue or report of this bug, related links). Search URLs are neither;
    a link into another project's tracker is related, not the report."""
    reported, related = [], []
    repository = _repository_of(diff)
    for link in dict.fromkeys(b for b in (*re.split(r"[\s,]+", diff.header.get("Bug", "")), *patch.upstream.bug) if b):
        if not link.startswith("http") or "?q=" in link or "/search" in link or "/issues?" in link:
            continue  # "no issue filed", or a search: not a report
        match = re.match(r"https://github\.com/([^/]+/[^/]+)/(issues|pull)/\d+", link)
        if match and repository and match.group(1).lower() != repository.lower():
            related.append(link)
        else:
            reported.append(link)
    return reported, related


def pr_body(patch: Any, diff: Any, test_ids: Optional[List[str]] = None, report: Any = None) -> str:
    subject, body = diff.description
    reported, related = issue_links(patch, diff)
    package_files = [s.path for s in diff.package_sections()]
    lines = ["## Problem", "", body or subject, ""]
    lines += ["Reported in: " + ", ".join(reported) if reported else "No issue filed.", ""]
    if related:
        lines += ["Related: " + ", ".join(related), ""]
    lines += ["## Minimal reproducer", ""]
    standalone = standalone_reproducer(diff)
    if standalone is not None:
        source = standalone.read_text()
        fields = reproducer_fields(source)
        lines.append("Needs only the packages this PR touches (and torch); it builds a tiny random model."
                     + (f" Without the fix it fails with `{fields['Fails with']}`." if fields.get("Fails with") else ""))
        lines += ["", "```python", source.rstrip(), "```", ""]
    else:
        reproducer, scenarios = _reproducer(patch)
        main = next((s for s in scenarios if s["expected_error"] and s["in_selftest"]), scenarios[0]) if scenarios else None
        if reproducer and main:
            error = main["expected_error"]
            lines += [f"`{main['function']}` from `{main['module']}`: {main['description'] or main['name']}"
                      + (f". Without the fix it raises `{error}`." if error else "."), "",
                      "```python", reproducer.rstrip(), "```", ""]
            others = [s for s in scenarios if s is not main]
            if others:
                lines += ["Other scenarios of the same bug:", ""]
                lines += [f"- `{s['function']}`: {s['description'] or s['name']}"
                          + (f". Without the fix it raises `{s['expected_error']}`." if s["expected_error"] else "")
                          for s in others] + [""]
        else:
            lines += ["(no reproducer shipped with this patch)", ""]
    lines += ["## Fix", "", subject, "", "Changed: " + (", ".join(f"`{p}`" for p in package_files) or "(none)"), ""]
    lines += ["## Test", ""]
    tests = test_ids if test_ids is not None else _added_tests(diff.other_sections())
    if tests:
        lines += ["Regression test(s) added:", ""] + [f"- `{t}`" for t in tests] + [""]
        lines += ["```", "python -m pytest " + " ".join(tests), "```", ""]
    elif diff.other_sections():
        lines += ["Tests changed: " + ", ".join(f"`{s.path}`" for s in diff.other_sections()), ""]
    else:
        lines += ["No upstream test covers this code yet; the reproducer above fails before the fix and passes after it.", ""]
    if report is not None:
        lines += ["Checked before opening this PR:", "", "```", report.format(), "```", ""]
    lines += [f"This change comes from the metapatch patch `{patch.id}` ({patch.title}), which carries it as a "
              "version-gated monkeypatch until a release has the fix.", ""]
    return "\n".join(lines)


def _added_tests(sections: Sequence[Any]) -> List[str]:
    found = []
    for section in sections:
        for line in section.text.splitlines():
            match = re.match(r"^\+\s*(?:async\s+)?def (test\w*)\(", line)
            if match:
                found.append(f"{section.path}::{match.group(1)}")
    return found
