"""Which patches ran, and how often: counted only under ``METAPATCH_DEBUG=1`` (``metapatch run --report`` sets it
for the program), reported on stderr when the process exits.

A patch applied where the installed versions have its bug may still never run in a given program (its target is
never called): the report tells a user which patches their program needed, so which pins they still need. Without
the variable nothing here runs: the registry installs the patches' replacements as they are, so counting costs a
program nothing unless asked for. With it, each replacement is installed behind a counter (one dictionary update
per call of a patched function).

Import-cheap: os, sys, functools and types only.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any, Callable, Dict, Tuple

DEBUG_ENV = "METAPATCH_DEBUG"

# (patch id, target "module:qualname") -> calls since the replacement was installed
COUNTS: Dict[Tuple[str, str], int] = {}
UNCOUNTED: Dict[Tuple[str, str], str] = {}  # targets whose replacement cannot be counted, and why
_REPORTING = False


def enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _key(patch_id: str, dotted: str) -> Tuple[str, str]:
    key = (patch_id, dotted)
    COUNTS.setdefault(key, 0)
    return key


def counting_wrapper(patch_id: str, dotted: str, wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapt wrapper ``(wrapped, instance, args, kwargs)`` that counts, then runs ``wrapper``."""
    key = _key(patch_id, dotted)

    def counted(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        COUNTS[key] += 1
        return wrapper(wrapped, instance, args, kwargs)

    return counted


def counting_replacement(patch_id: str, dotted: str, installed: Any) -> Any:
    """``installed`` behind a counter where its kind allows (a function, a property, a static or class
    method); anything else (a class) is returned as it is and listed as not counted."""
    key = _key(patch_id, dotted)

    def count(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            COUNTS[key] += 1
            return function(*args, **kwargs)

        return counted

    kind = type(installed)  # kept: a patch may install a subclass (a property that takes attributes)
    if isinstance(installed, types.FunctionType):
        return count(installed)
    if isinstance(installed, property) and installed.fget is not None:
        return kind(count(installed.fget), installed.fset, installed.fdel, installed.__doc__)
    if isinstance(installed, (staticmethod, classmethod)):
        return kind(count(installed.__func__))
    COUNTS.pop(key, None)
    UNCOUNTED[key] = kind.__name__
    return installed


def counted_replacement(patch_id: str, dotted: str, installed: Any, marker: str) -> Any:
    """:func:`counting_replacement`, or ``installed`` itself wherever the counted object would not behave the
    same (it takes no ``marker`` attribute, its attributes differ): counting never changes what a patch does."""
    try:
        counted = counting_replacement(patch_id, dotted, installed)
        if counted is not installed:
            for name, value in getattr(installed, "__dict__", {}).items():
                if name not in getattr(counted, "__dict__", {}):
                    setattr(counted, name, value)
            setattr(counted, marker, None)
        return counted
    except Exception as exc:  # noqa: BLE001 - fall back to the patch as written
        COUNTS.pop((patch_id, dotted), None)
        UNCOUNTED[(patch_id, dotted)] = f"{type(installed).__name__} ({type(exc).__name__})"
        return installed


def report_at_exit(registry: Any) -> None:
    """Print :func:`report` to stderr when the interpreter exits (once per process)."""
    global _REPORTING
    if _REPORTING:
        return
    _REPORTING = True
    import atexit

    atexit.register(lambda: _print(registry))


def _print(registry: Any) -> None:
    try:
        text = report(registry)
    except Exception as exc:  # noqa: BLE001 - never fail a program's exit
        text = f"metapatch: no run report ({type(exc).__name__}: {exc})"
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def report(registry: Any) -> str:
    """Which patches applied in this process, and how often each one's code ran."""
    rows = registry.status()
    calls: Dict[str, Dict[str, int]] = {}
    for (patch_id, dotted), number in COUNTS.items():
        calls.setdefault(patch_id, {})[dotted] = number
    applied = [row for row in rows if row["state"] == "applied" or calls.get(row["id"])]
    ran = [row for row in applied if sum(calls.get(row["id"], {}).values())]
    idle = [row for row in applied if row not in ran]
    program = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:4])) or "python"
    out = [f"metapatch run report (pid {os.getpid()}, {program}): {len(ran)} patch(es) ran, "
           f"{len(idle)} applied but never ran, {len(rows) - len(applied)} not applied"]
    for row in ran:
        per_target = calls[row["id"]]
        total = sum(per_target.values())
        detail = ", ".join(f"{dotted} {n}" for dotted, n in sorted(per_target.items(), key=lambda kv: -kv[1]) if n)
        out.append(f"  ran      {row['id']}: {total} call(s) ({detail})")
    for row in idle:
        uncounted = [d for (p, d) in UNCOUNTED if p == row["id"]]
        note = f" (not counted: {', '.join(uncounted)})" if uncounted else ""
        out.append(f"  idle     {row['id']}: applied, never called in this process{note}")
    waiting = [row["id"] for row in rows if row["state"] == "pending-import"]
    if waiting:
        out.append(f"  pending  {', '.join(waiting)}: their targets were never imported")
    out.append("  (ran: a patched function was called, so the fix was on this program's path; idle: applied, never on it)")
    needed = sorted({dist for row in ran for dist in row["affects"]})
    if needed:
        out.append(f"  this run needed metapatch for: {', '.join(needed)} (`metapatch pins` prints the pins)")
    else:
        out.append("  no patch ran: this run did not need metapatch (on these versions, with this workload)")
    return "\n".join(out)
