"""Child process entry: ``python -m metapatch.selftest._child module:function WORKDIR RESULT``."""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path


def main(function: str, workdir: str, result_file: str) -> int:
    import metapatch  # noqa: F401 - inert under METAPATCH_DISABLE=all, active otherwise

    module_name, _, name = function.partition(":")
    result = {"passed": False, "metrics": {}}
    try:
        func = getattr(importlib.import_module(module_name), name)
        _check_requires()
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


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
