"""What `metapatch pr` runs before it prints `gh pr create`: upstream's own tests for the touched
files, the diff's regression tests, and upstream's linters with upstream's configuration.

Everything runs in two throw-away worktrees of the clone:
  base  the base commit: upstream's tests as they are; then with only the diff's test files added,
        for the regression tests (which must fail there)
  with  the base commit plus the whole diff
The clone's own source is imported (``src/`` or the root first on ``PYTHONPATH``), so the tests
measure the code being proposed, not the installed release. A refusal lists every failure.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from metapatch._framework.records import PROJECTS

PASSED, FAILED, SKIPPED, MISSING = "passed", "failed", "skipped", "not collected"


@dataclass
class CheckOptions:
    tests: bool = True  # upstream's tests of the touched files and the regression tests
    lint: bool = True
    python: str = ""  # interpreter for upstream's tests (default: the one running metapatch)
    pytest_args: Sequence[str] = ()
    ruff: Optional[str] = None  # ruff executable (default: ruff on PATH, else `python -m ruff`)
    timeout: int = 1800


@dataclass
class CheckReport:
    test_files: List[str] = field(default_factory=list)
    regression: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # test id -> (base, with)
    base_counts: Dict[str, int] = field(default_factory=dict)
    with_counts: Dict[str, int] = field(default_factory=dict)
    broken: List[str] = field(default_factory=list)  # passed on the base, fail with the diff
    lint: List[str] = field(default_factory=list)  # one line per linter run
    failures: List[str] = field(default_factory=list)  # why the PR is refused
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = []
        if self.test_files:
            lines.append(f"upstream tests of the touched files ({', '.join(self.test_files)}):")
            lines.append(f"  base: {_counts(self.base_counts)}; with the diff: {_counts(self.with_counts)}")
        if self.regression:
            lines.append("regression tests (must fail on the base, pass with the diff):")
            lines += [f"  {test}: base {base}, with the diff {with_}" for test, (base, with_) in self.regression.items()]
        lines += [f"lint: {line}" for line in self.lint]
        lines += [f"note: {note}" for note in self.notes]
        if self.failures:
            lines.append("refused because:")
            lines += ["  - " + failure.replace("\n", "\n    ") for failure in self.failures]
        return "\n".join(lines)


def _counts(counts: Dict[str, int]) -> str:
    return ", ".join(f"{counts.get(k, 0)} {k}" for k in (PASSED, FAILED, SKIPPED))


# ---------------------------------------------------------------------------------------------
# Which tests


def touched_test_files(tree: Path, diff) -> List[str]:
    """The diff's own test files, plus upstream's test module of each touched source file
    (``src/accelerate/hooks.py`` -> ``tests/test_hooks.py``) where one exists in ``tree``."""
    found = [s.path for s in diff.other_sections() if _is_test_file(s.path)]
    for section in diff.package_sections():
        stem = Path(section.path).stem
        for candidate in (f"tests/test_{stem}.py", *(str(p.relative_to(tree)) for p in sorted(tree.glob(f"tests/*/test_{stem}.py")))):
            if (tree / candidate).is_file():
                found.append(candidate)
    return list(dict.fromkeys(found))


def _is_test_file(path: str) -> bool:
    name = Path(path).name
    return path.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def added_test_names(diff) -> Dict[str, List[str]]:
    """Test functions the diff adds (``+def test_x``), per test file."""
    found: Dict[str, List[str]] = {}
    for section in diff.other_sections():
        for line in section.text.splitlines():
            match = re.match(r"^\+\s*(?:async\s+)?def (test\w*)\(", line)
            if match:
                found.setdefault(section.path, []).append(match.group(1))
    return found


def test_ids(tree: Path, diff) -> List[str]:
    """pytest node ids of the added tests, with their class (``tests/test_hooks.py::HooksModelTester::test_x``),
    read from the files as the diff leaves them in ``tree``."""
    ids = []
    for path, names in added_test_names(diff).items():
        source = tree / path
        where = _qualified_tests(source.read_text()) if source.is_file() else {}
        ids += [f"{path}::{where.get(name, name)}" for name in names]
    return ids


def _qualified_tests(source: str) -> Dict[str, str]:
    qualified = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qualified[node.name] = node.name
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualified.setdefault(item.name, f"{node.name}::{item.name}")
    return qualified


# ---------------------------------------------------------------------------------------------
# Running pytest in a worktree


def _source_path(tree: Path, package: str) -> str:
    return str(tree / "src") if (tree / "src" / package).is_dir() else str(tree)


def run_pytest(tree: Path, package: str, targets: Sequence[str], options: CheckOptions,
               report: Path, collect_only: bool = False) -> Tuple[Dict[str, str], str]:
    """(outcome per node id, output tail). The clone's own package is imported, metapatch is off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_")}
    env.update(METAPATCH_DISABLE="all", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (_source_path(tree, package), env.get("PYTHONPATH", "")) if p))
    command = [options.python or _default_python(), "-m", "pytest", "-p", "no:cacheprovider", "-q",
               "-o", "junit_family=xunit1", f"--junitxml={report}", *options.pytest_args, *targets]
    if collect_only:
        command.insert(command.index("-q"), "--collect-only")
    try:
        proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=options.timeout)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        return {}, f"timed out after {options.timeout}s: {' '.join(command)}\n{exc.stdout or ''}"
    if collect_only:
        return {line.strip(): PASSED for line in proc.stdout.splitlines() if "::" in line}, output[-4000:]
    return (_junit_outcomes(report) if report.exists() else {}), output[-4000:]


def _default_python() -> str:
    import sys

    return sys.executable


def _junit_outcomes(report: Path) -> Dict[str, str]:
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        file, classname, name = case.get("file") or "", case.get("classname") or "", case.get("name") or ""
        module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        inner = classname[len(module) + 1:] if module and classname.startswith(module + ".") else ""
        node = "::".join(p for p in (file, *inner.split(".")) if p) + "::" + name
        kinds = {child.tag for child in case}
        outcomes[node] = FAILED if kinds & {"failure", "error"} else SKIPPED if "skipped" in kinds else PASSED
    return outcomes


def outcome_of(test_id: str, outcomes: Dict[str, str]) -> str:
    """A test id's outcome; for a parametrized test, failed if any case failed."""
    matches = [o for node, o in outcomes.items() if node == test_id or node.startswith(test_id + "[")]
    if not matches:
        return MISSING
    return FAILED if FAILED in matches else PASSED if PASSED in matches else SKIPPED


def compare_tests(base: Dict[str, str], with_: Dict[str, str], regression: Sequence[str], report: CheckReport,
                  regression_base: Optional[Dict[str, str]] = None) -> None:
    """Fill ``report``: counts, upstream tests the diff breaks (``base``: upstream's files as they are
    on the base), and the regression tests' verdicts (``regression_base``: their outcomes on the base
    with the diff's test files; every one must pass with the diff, at least one must fail on the base)."""
    regression_base = base if regression_base is None else regression_base
    for name, outcomes, counts in (("base", base, report.base_counts), ("with", with_, report.with_counts)):
        for outcome in outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
    report.broken = sorted(t for t, o in base.items() if o == PASSED and with_.get(t, MISSING) in (FAILED, MISSING))
    if report.broken:
        report.failures.append(f"{len(report.broken)} upstream test(s) pass on the base and fail with the diff: "
                               + ", ".join(report.broken))
    if not regression:
        report.failures.append("the diff adds no regression test (a `def test_...` in upstream's tests)")
        return
    for test in regression:
        report.regression[test] = (outcome_of(test, regression_base), outcome_of(test, with_))
    for test, (on_base, with_diff) in report.regression.items():
        if MISSING in (on_base, with_diff):
            where = "on the base (a collection error there: see the output)" if on_base == MISSING else "with the diff"
            report.failures.append(f"{test} is not collected {where}")
        elif with_diff != PASSED:
            report.failures.append(f"{test} {with_diff} with the diff: the diff does not fix what it tests")
        elif on_base == PASSED:
            report.notes.append(f"{test} passes on the base too: it pins behaviour the diff keeps")
    if not any(on_base == FAILED for on_base, _ in report.regression.values()):
        report.failures.append("no regression test fails on the base: none of them shows the bug")


# ---------------------------------------------------------------------------------------------
# Linters, with upstream's configuration


def uses_ruff(tree: Path) -> bool:
    pyproject = tree / "pyproject.toml"
    return ((tree / "ruff.toml").is_file() or (tree / ".ruff.toml").is_file()
            or (pyproject.is_file() and "[tool.ruff" in pyproject.read_text()))


def pinned_ruff(tree: Path) -> Optional[str]:
    """The ruff version upstream pins (setup.py extras, pyproject, or its pre-commit hook)."""
    for name in ("setup.py", "pyproject.toml", "setup.cfg"):
        path = tree / name
        if path.is_file():
            match = re.search(r"""["']ruff\s*(?:==|~=|>=)\s*([0-9][0-9.]*)""", path.read_text())
            if match:
                return match.group(1)
    hooks = tree / ".pre-commit-config.yaml"
    if hooks.is_file():
        match = re.search(r"astral-sh/ruff-pre-commit\s*\n\s*rev:\s*v?([0-9.]+)", hooks.read_text())
        if match:
            return match.group(1)
    return None


def ruff_command(options: CheckOptions) -> Optional[List[str]]:
    if options.ruff:
        return [options.ruff]
    found = shutil.which("ruff")
    if found:
        return [found]
    probe = subprocess.run([options.python or _default_python(), "-m", "ruff", "--version"], capture_output=True)
    return [options.python or _default_python(), "-m", "ruff"] if probe.returncode == 0 else None


def _ruff_findings(ruff: List[str], tree: Path, files: Sequence[str]) -> Tuple[List[str], List[str], str]:
    """(lint findings without line numbers, unformatted files, raw output) for ``files`` in ``tree``."""
    present = [f for f in files if (tree / f).is_file()]
    if not present:
        return [], [], ""
    check = subprocess.run([*ruff, "check", "--no-fix", "--output-format", "concise", *present],
                           cwd=tree, capture_output=True, text=True)
    findings = [re.sub(r":\d+:\d+:", ":", line) for line in check.stdout.splitlines()
                if re.match(r"^\S+\.py:\d+:\d+: ", line)]
    fmt = subprocess.run([*ruff, "format", "--check", *present], cwd=tree, capture_output=True, text=True)
    unformatted = [line.split("Would reformat: ", 1)[1].strip() for line in fmt.stdout.splitlines()
                   if line.startswith("Would reformat: ")]
    return findings, unformatted, check.stdout + fmt.stdout + fmt.stderr


def lint(base: Path, with_: Path, files: Sequence[str], options: CheckOptions, report: CheckReport) -> None:
    """Refuse what the diff adds: lint findings the base does not have, files it leaves unformatted."""
    python_files = [f for f in files if f.endswith(".py")]
    if not python_files:
        return
    if not uses_ruff(with_):
        report.notes.append("upstream configures no ruff; no linter run")
        return
    ruff = ruff_command(options)
    pinned = pinned_ruff(with_)
    if ruff is None:
        report.failures.append(f"upstream lints with ruff{'==' + pinned if pinned else ''}, which is not installed: "
                               "install it, pass --ruff PATH, or --skip-lint")
        return
    version = subprocess.run([*ruff, "--version"], capture_output=True, text=True).stdout.strip()
    if pinned and pinned not in version:
        report.notes.append(f"upstream pins ruff {pinned}; this is {version}: findings may differ from upstream's CI")
    base_findings, base_unformatted, _ = _ruff_findings(ruff, base, python_files)
    findings, unformatted, output = _ruff_findings(ruff, with_, python_files)
    remaining = list(base_findings)
    new = []
    for finding in findings:
        if finding in remaining:
            remaining.remove(finding)
        else:
            new.append(finding)
    newly_unformatted = [f for f in unformatted if f not in base_unformatted]
    report.lint.append(f"{version} check: {len(findings)} finding(s) ({len(new)} new); format --check: "
                       f"{len(unformatted)} file(s) to reformat ({len(newly_unformatted)} new); on {', '.join(python_files)}")
    if new:
        report.failures.append("`ruff check` (upstream's configuration) finds what the diff adds:\n" + "\n".join(new))
    if newly_unformatted:
        report.failures.append("`ruff format --check` (upstream's configuration) would reformat: " + ", ".join(newly_unformatted))


# ---------------------------------------------------------------------------------------------
# The whole check


def run_checks(base: Path, with_: Path, diff, options: CheckOptions, scratch: Path,
               add_tests_to_base: Callable[[], None]) -> CheckReport:
    """Lint, then upstream's test files on the untouched base and with the diff, then the regression
    tests on the base once ``add_tests_to_base()`` has put the diff's test files there."""
    report = CheckReport()
    changed = [s.path for s in diff.sections]
    if options.lint:
        lint(base, with_, changed, options, report)
    if options.tests:
        files = touched_test_files(with_, diff)
        report.test_files = files
        regression = test_ids(with_, diff)
        base_files = [f for f in files if (base / f).is_file()]
        base_out, _ = run_pytest(base, diff.package, base_files, options, scratch / "base.xml") if base_files else ({}, "")
        with_out, with_log = run_pytest(with_, diff.package, files, options, scratch / "with.xml") if files else ({}, "")
        if files and not with_out:
            report.failures.append(f"pytest collected nothing with the diff:\n{with_log[-1500:]}")
        regression_base: Dict[str, str] = {}
        if regression:
            add_tests_to_base()
            regression_base, log = run_pytest(base, diff.package, regression, options, scratch / "regression.xml")
            if not regression_base:
                report.notes.append(f"the regression tests on the base:\n{log[-1500:]}")
        compare_tests(base_out, with_out, regression, report, regression_base)
    else:
        report.notes.append("upstream and regression tests not run (--skip-tests)")
    return report


# The GitHub repository of each package's upstream (issue links into another tracker are "related"):
# a view of the project records, for callers that import it from here.
REPOSITORIES = {name: project.repository for name, project in PROJECTS.items()}
