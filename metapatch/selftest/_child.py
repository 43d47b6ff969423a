"""Child process entry: ``python -m metapatch.selftest._child module:function WORKDIR RESULT``."""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path


def main(function: str, workdir: str, result_file: str) -> int:
    import metapatch  # noqa: F401 - inert under METAPATCH_DISABLE=all, active otherwise

    from metapatch.selftest import _device

    module_name, _, name = function.partition(":")
    result = {"passed": False, "metrics": {}}
    try:
        func = getattr(importlib.import_module(module_name), name)
        _check_requires()
        # Decided here, in the process that computes (never in the warm parent it was forked from), and
        # recorded below whatever the scenario does with it.
        _device.execution_device()
        result["metrics"] = func(Path(workdir)) or {}
        result["passed"] = True
    except BaseException as exc:  # the outcome is the data: report every kind of failure
        result["error_type"] = type(exc).__name__
        result["error"] = str(exc)[:2000]
        result["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-6000:]
        if _not_applicable(exc):
            # Only the scenario's explicit NotApplicable: an ImportError of a model class stays
            # a failure (the scenario should have checked and raised NotApplicable itself).
            result["not_applicable"] = str(exc) or "not applicable to the installed versions"
    result.update(_device.report())
    result["metapatch_status"] = {row["id"]: row["state"] for row in metapatch.status()}
    Path(result_file).write_text(json.dumps(result, default=str))
    return 0


def _check_requires() -> None:
    """The scenario's ``requires`` (passed by the harness): NotApplicable where they are not met."""
    import os

    from metapatch.selftest import NotApplicable
    from metapatch.selftest._harness import REQUIRES_ENV, unmet

    requires = json.loads(os.environ.get(REQUIRES_ENV) or "{}")
    why = unmet(requires)
    if why:
        raise NotApplicable(why)


def _not_applicable(exc: BaseException) -> bool:
    from metapatch.selftest import NotApplicable

    return isinstance(exc, NotApplicable)


def patch_sites(workdir: Path) -> dict:
    """A run's view of the patches once the stack is imported (PRELOAD, in this process or in the warm
    parent it was forked from): each patch's state and notes, each site's holders (every loaded module
    whose namespace holds the original, i.e. calls that bypass the patch, and the replacement). A
    forked child must see what a fresh interpreter sees: tests/test_selftest_speed.py compares them."""
    import importlib.util

    import metapatch
    from metapatch._sites import namespace
    from metapatch.selftest._harness import PRELOAD

    for name in PRELOAD:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(name)
    modules = [(n, namespace(m)) for n, m in sorted(sys.modules.items()) if m is not None]
    view = {}
    for patch_id, status in sorted(metapatch.registry._status.items()):
        sites = {}
        for dotted, site in sorted(status.sites.items()):
            sites[dotted] = {
                "holds_installed": site.holds_installed(),
                "original_in": [n for n, ns in modules if any(v is site.original for v in ns.values())],
                "installed_in": [n for n, ns in modules if any(v is site.installed for v in ns.values())],
            }
        view[patch_id] = {"state": str(status.state), "notes": list(status.notes), "sites": sites}
    return {"patches": view, "modules": sorted(n for n, _ in modules if n.partition(".")[0] in
                                               ("transformers", "accelerate", "peft", "bitsandbytes"))}


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
