"""The pull-request body `metapatch pr` writes: the problem, the standalone reproducer (or one
extracted from the patch's selftest scenario), the fix, pytest-resolvable test ids, the checks'
report and the issue links. No git and no subprocess here: pr.py runs those."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

# In the body of a PR that depends on another one of its series: replaced by that PR's number once it
# is opened (pr.series_script does it).
DEPENDS_ON = "#DEPENDS_ON"


def reproducer_source(patch: Any) -> str:
    """A self-contained reproducer: the patch's main selftest scenario function with the module
    helpers, constants and imports it uses (relative imports made absolute)."""
    return _reproducer(patch)[0]


def _reproducer(patch: Any) -> "tuple[str, List[dict]]":
    """(source of the main scenario, every scenario of the patch as a dict)."""
    from metapatch._framework import layout

    if not layout.scenarios(patch):
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
    """The patch's scenarios from ``SCENARIOS`` in its selftest module (:func:`metapatch._framework.layout.scenarios`).
    Importing a selftest module is cheap by convention (torch is imported inside the scenario functions)."""
    import importlib

    from metapatch._framework import layout

    try:
        module = importlib.import_module(layout.scenarios(patch))
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
    """``upstream_diffs/<id>/<diff stem>.reproducer.py``, for diff N of a series ``reproducer-N.py``,
    else ``reproducer.py``: one short file that needs only the upstream packages and fails on the
    base."""
    own = [f"reproducer-{diff.series_index}.py"] if getattr(diff, "series_index", None) else []
    for name in (f"{diff.path.stem}.reproducer.py", *own, "reproducer.py"):
        path = diff.path.parent / name
        if path.is_file():
            return path
    return None


def reproducer_fields(source: str) -> dict:
    """``Scenario:``, ``Fails with:`` and ``Affected:`` lines of a reproducer's docstring. ``Fails with`` names
    an error class, or alternatives by release (``ValueError|AssertionError``): :func:`failure_classes`."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    fields = {}
    for key in ("Scenario", "Fails with", "Affected"):
        match = re.search(rf"(?m)^{key}:\s*(.+)$", doc)
        if match:
            fields[key] = match.group(1).strip()
    return fields


def failure_classes(fields: dict) -> list:
    """The error classes a reproducer's ``Fails with:`` allows (one, or ``|``-separated alternatives)."""
    return [name.strip() for name in fields.get("Fails with", "").split("|") if name.strip()]


def _repository_of(diff: Any) -> Optional[str]:
    from metapatch._framework.records import project_of

    return project_of(diff.package).repository or None


def issue_links(patch: Any, diff: Any) -> "tuple[List[str], List[str]]":
    """(links to a filed issue or report of this bug, related links). Search URLs are neither;
    a link into another project's tracker is related, not the report. A diff of a series has its
    own bug: only its ``Bug:`` header counts, not the links of the patch as a whole."""
    reported, related = [], []
    repository = _repository_of(diff)
    patch_links = () if getattr(diff, "series_index", None) else patch.upstream.bug
    for link in dict.fromkeys(b for b in (*re.split(r"[\s,]+", diff.header.get("Bug", "")), *patch_links) if b):
        if not link.startswith("http") or "?q=" in link or "/search" in link or "/issues?" in link:
            continue  # "no issue filed", or a search: not a report
        match = re.match(r"https://github\.com/([^/]+/[^/]+)/(issues|pull)/\d+", link)
        if match and repository and match.group(1).lower() != repository.lower():
            related.append(link)
        else:
            reported.append(link)
    return reported, related


def pr_body(patch: Any, diff: Any, test_ids: Optional[List[str]] = None, report: Any = None,
            series: Optional[Tuple[int, int, Optional[str]]] = None) -> str:
    """``series``: (N, number of diffs, branch of diff N-1 or None) for diff N of a series."""
    subject, body = diff.description
    reported, related = issue_links(patch, diff)
    package_files = [s.path for s in diff.package_sections()]
    lines = []
    if series is not None:
        number, total, previous = series
        lines += [f"Part {number} of {total} of a series of pull requests, each fixing one problem."
                  + (f" Depends on {DEPENDS_ON} (branch `{previous}`): this change is written on top of it, "
                     "please merge that one first." if previous else " The others are based on this one."), ""]
    lines += ["## Problem", "", body or subject, ""]
    lines += ["Reported in: " + ", ".join(reported) if reported else "No issue filed.", ""]
    if related:
        lines += ["Related: " + ", ".join(related), ""]
    lines += ["## Minimal reproducer", ""]
    standalone = standalone_reproducer(diff)
    if standalone is not None:
        source = standalone.read_text()
        errors = failure_classes(reproducer_fields(source))
        lines.append("Needs only the packages this PR touches (and torch); it builds a tiny random model."
                     + (" Without the fix it fails with " + " or ".join(f"`{name}`" for name in errors)
                        + (" (depending on the release)" if len(errors) > 1 else "") + "." if errors else ""))
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
