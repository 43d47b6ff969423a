"""The selftest package's layout: one public module per patch id declaring that patch's
scenarios, private modules for what several share, and imports that still resolve after a module
moved (an import inside a scenario function only fails when the scenario runs, and a scenario that
catches it reports n/a instead)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import metapatch.selftest as selftest_package

SELFTEST = Path(selftest_package.__file__).parent


def _public_modules():
    return [info.name for info in pkgutil.iter_modules(selftest_package.__path__) if not info.name.startswith("_")]


def test_each_public_module_declares_the_scenarios_of_the_patch_it_is_named_after():
    from metapatch._framework.registry import load_patches

    ids = {patch.id for patch in load_patches()}
    for name in _public_modules():
        module = importlib.import_module(f"metapatch.selftest.{name}")
        declared = {scenario.patch_id for scenario in getattr(module, "SCENARIOS", ())}
        assert declared == {name.replace("_", "-")}, (name, declared)
        assert name.replace("_", "-") in ids, f"selftest/{name}.py is named after no patch"


def _imports(path: Path):
    """(line, module, names) of every ``from X import names`` in the file, in functions too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = ["metapatch", "selftest"][: 3 - node.level]
            module = ".".join(base + ([node.module] if node.module else []))
        elif node.module and node.module.startswith("metapatch"):
            module = node.module
        else:
            continue
        yield node.lineno, module, [alias.name for alias in node.names]


def test_every_metapatch_import_of_a_selftest_module_resolves():
    broken = []
    for path in sorted(SELFTEST.glob("*.py")):
        for line, module, names in _imports(path):
            try:
                imported = importlib.import_module(module)
            except ImportError as exc:
                broken.append(f"{path.name}:{line}: {module} ({exc})")
                continue
            for name in names:
                if not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        broken.append(f"{path.name}:{line}: {module} has no {name}")
    assert broken == []
