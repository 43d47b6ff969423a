"""metapatch selftest: the table it prints, one row per scenario, and its summary line."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

Row = Any  # metapatch.commands.selftest.Row (which imports this module)

COLUMNS = ("scenario", "affected", "unpatched", "patched", "device", "seconds", "verdict")


def _affected_text(row: Row) -> str:
    return {True: "yes", False: "no", None: "?"}[row.affected]


def _unpatched_text(row: Row) -> str:
    if row.unpatched is None:
        return "-"
    if row.unpatched.get("not_applicable"):
        return "n/a"
    return "passes" if row.unpatched["passed"] else str(row.unpatched["error_type"])


def _patched_text(row: Row) -> str:
    if row.patched is None:
        return "-"
    if row.patched.get("not_applicable"):
        return "n/a"
    if row.patched["passed"]:
        diff = row.patched.get("max_abs_diff")
        text = "pass" + (f", max diff {diff:g}" if isinstance(diff, (int, float)) else "")
    else:
        text = f"FAIL {row.patched['error_type']}"
    state = row.patched.get("patch_state")
    return f"{text} [{state}]" if state else text


def _device_text(row: Row) -> str:
    return (row.device or "-") + ("*" if row.device_note else "")


def cells(row: Row) -> List[str]:
    return [row.scenario, _affected_text(row), _unpatched_text(row), _patched_text(row), _device_text(row),
            f"{row.seconds:.1f}", row.verdict]


WIDTHS = (50, 8, 22, 34, 7, 7, 16)


def format_line(values: Sequence[str]) -> str:
    return "  ".join(str(v).ljust(w) for v, w in zip(values, WIDTHS)).rstrip()


def format_details(row: Row) -> List[str]:
    out = []
    if row.verdict in ("FAILED", "BUG OUTSIDE GATE", "not reproduced", "skipped"):
        out.append(f"    gate: {row.gate}")
    if row.device_note:
        out.append(f"    {row.device}*: {row.device_note}")
    if row.verdict == "FAILED" and any((r or {}).get("not_applicable") for r in (row.unpatched, row.patched)):
        out.append("    n/a in only one of the two runs: "
                   + "; ".join(f"{label}: {r.get('not_applicable') or 'ran'}"
                               for label, r in (("without metapatch", row.unpatched), ("with metapatch", row.patched))))
    elif row.patched and not row.patched["passed"]:
        out.append(f"    with metapatch: {row.patched['error_type']}: {row.patched['error']}")
        out.extend("    | " + line for line in row.patched["traceback_tail"].strip().splitlines()[-6:])
    if row.verdict == "BUG OUTSIDE GATE" and row.unpatched:
        out.append(f"    without metapatch: {row.unpatched['error_type']}: {row.unpatched['error']}")
    return out


def _timed_out(row: Row) -> bool:
    return row.verdict.startswith("TIMED OUT")


def nothing_ran(rows: Sequence[Row]) -> bool:
    """No scenario ran here: each one was skipped (a package missing) or n/a."""
    return all(row.verdict == "skipped" or row.not_applicable for row in rows)


def summary_line(rows: Sequence[Row], seconds: float) -> str:
    failed = [r.scenario for r in rows if not r.ok and not _timed_out(r)]
    timed_out = [r.scenario for r in rows if _timed_out(r)]
    counts: Dict[str, int] = {}
    for row in rows:
        kind = "n/a" if row.not_applicable else ("timed out" if _timed_out(row) else row.verdict)
        counts[kind] = counts.get(kind, 0) + 1
    text = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no scenarios"
    verdicts = []
    if failed:
        verdicts.append(f"NOT fixed here: {', '.join(failed)}")
    if timed_out:
        verdicts.append(f"timed out (no result, so no verdict): {', '.join(timed_out)}")
    if not verdicts and nothing_ran(rows):
        missing = sorted({dist for row in rows for dist, version in row.installed.items() if version is None})
        verdicts.append("NOTHING RAN: every scenario was skipped or n/a on this install"
                        + (f" (not installed: {', '.join(missing)})" if missing else "")
                        + ", so nothing was checked")
    verdict = "; ".join(verdicts) or "metapatch fixes every affected scenario on this install"
    devices: Dict[str, int] = {}
    for row in rows:
        if row.device:
            where = row.device + (" (pinned)" if row.device_note else "")
            devices[where] = devices.get(where, 0) + 1
    where = f" Computed on {', '.join(f'{d}: {n}' for d, n in sorted(devices.items()))}." if devices else ""
    return f"{len(rows)} scenarios in {seconds:.0f} s ({text}). {verdict}.{where}"
