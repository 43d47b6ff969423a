"""Runs one report reproducer twice in one child process: without metapatch, then with it.

``tests/reports`` starts this through the selftest harness (a child forked from the warm parent,
with ``METAPATCH_DISABLE=all``): the first leg runs with every patch disabled; then the variable is
dropped and ``metapatch.install()`` applies the patches to the already imported modules (the same
path as ``import metapatch`` after transformers), and the second leg runs. Sharing the child halves
the interpreter start-ups and imports, which dominate a tiny reproducer's cost.

The reproducer is ``METAPATCH_REPORT_CASE=/path/to/case.py:function``; it gets a working directory
per leg (a sibling ``shared`` folder holds checkpoints both legs reuse) and raises when the
behaviour is wrong. Each leg's outcome is returned as data; this function never raises.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict


def load_case(spec: str) -> Callable[[Path], Any]:
    path, _, name = spec.rpartition(":")
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so a case imports its sibling helpers (_tiny.py)
    module_name = "metapatch_report_case_" + Path(path).stem
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        loader_spec.loader.exec_module(module)
    return getattr(module, name)


def _leg(func: Callable[[Path], Any], workdir: Path) -> Dict[str, Any]:
    from metapatch.selftest import NotApplicable

    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result: Dict[str, Any] = {"passed": False}
    try:
        result["metrics"] = func(workdir) or {}
        result["passed"] = True
    except NotApplicable as exc:
        result["not_applicable"] = str(exc) or "not applicable to the installed versions"
    except BaseException as exc:  # noqa: BLE001 - the outcome is the data
        result["error_type"] = type(exc).__name__
        result["error"] = str(exc)[:2000]
        result["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:]
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def both_legs(workdir: Path) -> Dict[str, Any]:
    import metapatch

    func = load_case(os.environ["METAPATCH_REPORT_CASE"])
    legs = {"unpatched": _leg(func, workdir / "unpatched")}
    legs["unpatched"]["states"] = {row["id"]: row["state"] for row in metapatch.status()}
    if os.environ.get("METAPATCH_REPORT_LEGS", "both") == "both":
        # METAPATCH_REPORT_PATCHED_DISABLE: ids to keep off in the second leg (to tell which patch fixes it).
        keep_off = os.environ.get("METAPATCH_REPORT_PATCHED_DISABLE", "")
        if keep_off:
            os.environ["METAPATCH_DISABLE"] = keep_off
        else:
            os.environ.pop("METAPATCH_DISABLE", None)
        metapatch.install()
        legs["patched"] = _leg(func, workdir / "patched")
        legs["patched"]["states"] = {row["id"]: row["state"] for row in metapatch.status()}
    return legs
