"""metapatch selftest"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from . import selftest_schedule
from .selftest_schedule import Progress, chains  # noqa: F401 - the schedule, part of this command
from .selftest_table import COLUMNS, cells, format_details, format_line, nothing_ran, summary_line  # noqa: F401

HELP = ("run the shipped reproducers against the installed versions, each in a subprocess without and "
        "with metapatch, and show whether metapatch fixes them here: by default one scenario per patch (its "
        "representative first, then its others in order until one decides here: its bug and fix shown, or a "
        "pass where the install is not affected), two runs at a time; --all runs every scenario (exit 0 "
        "only when every scenario run passes with metapatch; scenarios that do not apply to the installed "
        "versions are reported n/a and do not change the exit code)")

EPILOG = """selection:
  (default)        one scenario per patch: its representative (the cheapest that shows the bug and
                   the fix on the releases it was measured on) first, then its other scenarios in
                   order until one decides here (not n/a, not skipped, not "not reproduced"), so every
                   patch's bug and fix is reproduced on this install where a scenario shows it
  --all            every scenario (what CI runs); --include-slow adds the test suite's slow variants
  --patch/--scenario  exactly the scenarios named

speed:
  each run is a fork of a warm parent that imported metapatch and then torch, transformers,
  accelerate, peft and bitsandbytes once (one parent without metapatch, one with it), in the order a
  fresh interpreter imports them; METAPATCH_SELFTEST_PRELOAD=0 keeps the parents to torch,
  METAPATCH_SELFTEST_FORK=0 starts a fresh interpreter per run. --json gives seconds and cpu_seconds
  (user + system, subprocesses included) per run: a busy machine stretches the first, not the second

device:
  each scenario computes on the execution device: cuda:0 where torch sees a CUDA device (GPU 0 in the
  device map, the offloaded rest on cpu/disk), cpu otherwise; METAPATCH_SELFTEST_DEVICE=cpu|cuda|cuda:N
  overrides it. Scenarios that cannot use a GPU (two ranks over gloo, a CPU-only kernel path) are pinned
  to cpu with CUDA hidden, and say why (DEVICE column, "device" and "device_note" in --json)

verdicts:
  fixed            affected install: fails without metapatch, passes with it
  not reproduced   affected install, but the unpatched run passed on this machine (the fix is still checked)
  passes           the scenario passes with and without metapatch (a regression guard, not affected, or
                   a flow upstream already handles on these releases, as the scenario declares)
  FAILED           the run with metapatch failed: metapatch does not fix this install (exit code 1)
  TIMED OUT        a run gave no result within --timeout: nothing is known (exit code 1; a busy machine,
                   or raise --timeout)
  BUG OUTSIDE GATE not affected by the version gate, yet the bug reproduces (exit code 1; please report)
  skipped          a package the scenario needs is not installed
  n/a (REASON)     the scenario's model class or API does not exist in the installed versions
                   (e.g. "needs transformers >= 5.5"), or the bug's code path is not taken on this
                   machine (e.g. a CPU kernel this CPU lacks): neither passed nor failed, exit code unchanged

exit code: 0 every scenario that ran passed with metapatch; 1 a scenario failed or timed out, a bug showed
outside a patch's gate, or nothing ran at all (every scenario skipped or n/a: no stack installed);
2 bad usage (--jobs below 1, a selection that matches nothing, a patch with no scenario).
A patch without a scenario of its own is named at the end.

environment:
  METAPATCH_SELFTEST_FORK=0      a fresh interpreter per run instead of a fork of a warm parent
  METAPATCH_SELFTEST_PRELOAD=0   the warm parents import torch only
  METAPATCH_SELFTEST_DEVICE=cpu|cuda|cuda:N   the execution device (default: cuda:0 where CUDA is present)
  METAPATCH_STRICT applies to the runs with metapatch as in any program; METAPATCH_DISABLE is ignored
                                 (the runs with metapatch have every patch; select with --patch/--scenario)
"""


@dataclass
class Row:
    scenario: str
    patch_id: str
    description: str
    affected: Optional[bool]
    gate: str
    installed: Dict[str, Optional[str]] = field(default_factory=dict)
    expected_error: str = ""
    unpatched: Optional[Dict[str, Any]] = None
    patched: Optional[Dict[str, Any]] = None
    verdict: str = ""
    ok: bool = True
    seconds: float = 0.0
    cpu_seconds: Optional[float] = None  # both runs' CPU time (None where unknown): what a quiet machine needs
    not_applicable: Optional[str] = None  # why the scenario does not apply here (verdict "n/a (...)")
    # What the scenario declares its unpatched run does on this install ("" passes, else the error
    # class(es)): where it declares a pass, an unpatched pass is "passes", not "not reproduced".
    declared_unpatched: Optional[str] = None
    device: Optional[str] = None  # where the runs computed ("cpu", "cuda:0"; None where neither said)
    device_note: Optional[str] = None  # why it is pinned to the CPU, where it is


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--json", action="store_true", help="machine-readable output (one object per scenario)")
    parser.add_argument("--patch", action="append", metavar="ID", default=[],
                        help="only the scenarios of this patch id (repeatable)")
    parser.add_argument("--scenario", action="append", metavar="KEY", default=[],
                        help="only this scenario, as PATCH_ID/NAME or NAME (repeatable)")
    parser.add_argument("--all", action="store_true", dest="run_all",
                        help="every scenario, not one per patch (what CI runs)")
    parser.add_argument("--include-slow", action="store_true",
                        help="also run the slow variants the test suite runs (in_selftest=False); implies --all")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), metavar="N",
                        help="runs at once (a scenario is two runs, without and with metapatch, which may go "
                             "out together; default: 2, or 1 on one core)")
    parser.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                        help="per run (default 300)")


def select(scenarios: Sequence[Any], patches: Sequence[str], names: Sequence[str], include_slow: bool) -> List[Any]:
    chosen = [s for s in scenarios if include_slow or s.in_selftest or s.key in names or s.name in names]
    if patches:
        chosen = [s for s in chosen if s.patch_id in patches]
    if names:
        chosen = [s for s in chosen if s.key in names or s.name in names]
    return chosen


def _outcome_summary(outcome: Any, patch_id: str) -> Dict[str, Any]:
    return {
        "passed": outcome.passed,
        "error_type": outcome.error_type,
        "error": (outcome.error or "")[:500] or None,
        "max_abs_diff": outcome.metrics.get("max_abs_diff"),
        "metrics": outcome.metrics,
        "seconds": round(outcome.seconds, 2),
        "cpu_seconds": outcome.cpu_seconds,
        "patch_state": outcome.states.get(patch_id),
        "traceback_tail": outcome.traceback[-1500:] if not outcome.passed else "",
        "not_applicable": outcome.not_applicable,
        "device": outcome.device,
    }


def judge(row: Row) -> Row:
    """Fill verdict and ok from the two outcomes."""
    unpatched, patched = row.unpatched or {}, row.patched or {}
    if unpatched.get("not_applicable") and (not patched or patched.get("not_applicable")):
        # The scenario cannot run on these versions (its model class is missing): the patched
        # run is skipped, as it would say the same, and nothing is claimed either way.
        row.not_applicable = unpatched["not_applicable"]
        row.verdict, row.ok = f"n/a ({row.not_applicable})", True
        return row
    if unpatched.get("not_applicable") or patched.get("not_applicable"):
        # Applicability does not depend on metapatch: one n/a run and one real run means the
        # scenario (or the patch) changes what exists, so neither result can be trusted.
        row.verdict, row.ok = "FAILED", False
        return row
    timed_out = [r for r in (unpatched, patched) if r.get("error_type") == TIMEOUT]
    if timed_out:
        # No result is no verdict: neither "fixed" (the unpatched run did not show the bug, it ran out of time)
        # nor "not fixed".
        row.verdict, row.ok = f"TIMED OUT ({timed_out[0].get('error') or 'no result'})", False
        return row
    reproduced = not unpatched.get("passed", True)
    if not patched.get("passed", False):
        row.verdict, row.ok = "FAILED", False
    elif row.affected is False and reproduced:
        # The gate says the install has no bug, so the patch stayed off, yet the scenario fails:
        # the gate is wrong for this install (the patched run "passed" only if something else fixed it).
        row.verdict, row.ok = "BUG OUTSIDE GATE", False
    elif reproduced:
        row.verdict = "fixed"
    elif row.affected and row.expected_error and row.declared_unpatched != "":
        # The scenario may know why its bug cannot show on this machine (a CPU kernel path this CPU
        # does not take): then it applies no more than a missing model class would.
        why = (unpatched.get("metrics") or {}).get("not_reproducible_here")
        if why:
            row.not_applicable = str(why)
            row.verdict = f"n/a ({row.not_applicable})"
        else:
            row.verdict = "not reproduced"
    else:
        row.verdict = "passes"
    return row


TIMEOUT = "TimeoutExpired"  # the harness's error_type for a run that gave no result in time


def _missing_distribution(reason: str) -> bool:
    return reason.endswith("is not installed")


def _missing_package(outcome: Any) -> bool:
    """The run failed because a whole distribution the scenario imports (peft, bitsandbytes) is
    not installed. A missing submodule (``transformers.models.gemma4``) or model class is not
    this: the scenario should have raised NotApplicable, so that stays a failure."""
    if outcome.passed or outcome.error_type != "ModuleNotFoundError":
        return False
    name = (outcome.error or "").partition("No module named ")[2].strip("'\" ")
    return bool(name) and "." not in name


def start_row(scenario: Any, registry: Any) -> Row:
    """The row of ``scenario`` before any run: its gate; verdict "skipped" already where a distribution
    its patch needs is not installed (then nothing is run)."""
    patch = registry.patches.get(scenario.patch_id)
    if patch is not None:
        affected, reason, installed, _ = registry.gate(patch)
    else:
        affected, reason, installed = None, "no patch with this id is registered", {}
    row = Row(scenario.key, scenario.patch_id, scenario.description, affected, reason, dict(installed),
              scenario.expected_error)
    if patch is not None:
        row.declared_unpatched = scenario.expected_unpatched(bool(affected)).error
    if patch is not None and not affected and _missing_distribution(reason):
        row.verdict, row.ok = "skipped", True
    return row


def finish_row(row: Row, unpatched: Any, patched: Optional[Any], seconds: float) -> Row:
    """Judge ``row`` from its runs. A patched run made while the unpatched one said n/a is dropped:
    applicability does not depend on metapatch, so it is not needed (and not shown)."""
    row.unpatched = _outcome_summary(unpatched, row.patch_id)
    row.patched = None
    if unpatched.not_applicable is None and patched is not None:
        row.patched = _outcome_summary(patched, row.patch_id)
    row.seconds = round(seconds, 2)
    for outcome in (patched, unpatched):
        if outcome is not None and outcome.device:
            row.device, row.device_note = outcome.device, outcome.device_note
            break
    cpu = [r.get("cpu_seconds") for r in (row.unpatched, row.patched) if r]
    row.cpu_seconds = round(sum(cpu), 2) if cpu and None not in cpu else None
    if row.patched is not None and _missing_package(patched):
        row.verdict, row.ok = "skipped", True  # an optional package the scenario imports is missing
        return row
    return judge(row)


def run_chains(work: List[List[Any]], quick: bool, jobs: int, registry: Any, timeout: float, on_row: Any,
               progress: Progress) -> List[Row]:
    """The scenarios' runs, scheduled by :func:`metapatch.commands.selftest_schedule.run_chains`, as rows of this command."""
    return selftest_schedule.run_chains(work, quick, jobs, registry, timeout, on_row, progress, start_row, finish_row)


def run_one(scenario: Any, registry: Any, timeout: float) -> Row:
    """One scenario, its two runs one after the other (the unpatched one first)."""
    from metapatch.selftest import run_scenario

    row = start_row(scenario, registry)
    if row.verdict == "skipped":
        return row
    started = time.perf_counter()
    unpatched = run_scenario(scenario, patched=False, timeout=timeout)
    patched = run_scenario(scenario, patched=True, timeout=timeout) if unpatched.not_applicable is None else None
    return finish_row(row, unpatched, patched, time.perf_counter() - started)


def exit_code(rows: Sequence[Row]) -> int:
    return 0 if rows and all(r.ok for r in rows) and not nothing_ran(rows) else 1


def without_scenarios(registry: Any, scenarios: Sequence[Any]) -> List[str]:
    """Ids of registered patches that have no scenario of their own."""
    have = {s.patch_id for s in scenarios}
    return [pid for pid in registry.patches if pid not in have]


def run(args: argparse.Namespace) -> int:
    import metapatch
    from metapatch.selftest import _device, all_scenarios

    from . import UsageError

    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: give at least 1 (runs at once)")
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print("metapatch selftest: NOTHING RAN: torch is not installed, and every reproducer needs it with the "
              "Hugging Face stack (see the README's set-up: pip install torch, then metapatch[hf])", file=sys.stderr)
        return 1
    try:
        _device.requested(os.environ.get(_device.DEVICE_ENV))  # each run decides; a typo is refused once, here
    except ValueError as exc:
        print(f"metapatch selftest: {exc}", file=sys.stderr)
        return 2
    every = all_scenarios()
    unknown = [pid for pid in args.patch if pid not in metapatch.registry.patches]
    if unknown:
        raise UsageError(_unknown_patch_text(unknown, metapatch.registry))
    bare = [pid for pid in args.patch if pid in without_scenarios(metapatch.registry, every)]
    if bare:
        raise UsageError(f"{', '.join(bare)}: no scenario of its own, so selftest cannot reproduce it here; "
                         "its tests run with the patch's own test file")
    scenarios = select(every, args.patch, args.scenario, args.include_slow)
    if not scenarios:
        print("metapatch selftest: no scenario matches"
              + (f" --patch {' '.join(args.patch)}" if args.patch else "")
              + (f" --scenario {' '.join(args.scenario)}" if args.scenario else ""), file=sys.stderr)
        return 2
    # Named scenarios are run as named; a bare `metapatch selftest` is the quick tour.
    quick = not (args.run_all or args.include_slow or args.patch or args.scenario)
    work = chains(scenarios, quick)
    jobs = args.jobs
    started = time.perf_counter()
    if not args.json:
        what = (f"one scenario per patch ({len(work)} patches, {len(scenarios)} scenarios in all; --all runs every one)"
                if quick else f"{len(scenarios)} scenarios")
        print(f"metapatch selftest: {what}, {jobs} runs at a time; progress here, on stderr", file=sys.stderr,
              flush=True)
        print(format_line([c.upper() for c in COLUMNS]), flush=True)

    def on_row(row: Row) -> None:
        if not args.json:
            print(format_line(cells(row)), flush=True)
            for line in format_details(row):
                print(line, flush=True)

    from metapatch.selftest._harness import warm_up

    warming = time.perf_counter()
    preloaded = warm_up()
    if preloaded is None:
        print("metapatch selftest: a fresh interpreter per run (METAPATCH_SELFTEST_FORK=0, or no os.fork)",
              file=sys.stderr, flush=True)
    else:
        from metapatch.selftest._harness import PRELOAD_SKIPPED

        imported = ", ".join(["torch", *(["metapatch", *preloaded] if preloaded else [])])
        left_out = "".join(f"; {name} imported by each run: it {why}" for name, why in PRELOAD_SKIPPED.items())
        print(f"metapatch selftest: warm parents ready in {time.perf_counter() - warming:.0f} s (imported once, "
              f"forked per run: {imported}{left_out})", file=sys.stderr, flush=True)
    progress = Progress(len(work), jobs, enabled=True)
    rows = run_chains(work, quick, jobs, metapatch.registry, args.timeout, on_row, progress)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "seconds": round(elapsed, 2),
                          "exit_code": exit_code(rows), "nothing_ran": nothing_ran(rows),
                          "without_scenario": without_scenarios(metapatch.registry, every),
                          "metapatch": metapatch.__version__,
                          "selection": "one per patch" if quick else "all"}, indent=2, default=str))
    else:
        bare = without_scenarios(metapatch.registry, every) if quick else []
        if bare:
            print(f"no scenario of its own (not checked here): {', '.join(bare)}")
        print(summary_line(rows, elapsed))
    return exit_code(rows)


def _unknown_patch_text(unknown: Sequence[str], registry: Any) -> str:
    import difflib

    close = sorted({m for pid in unknown for m in difflib.get_close_matches(pid, list(registry.patches), n=3)})
    return (f"unknown patch id(s) {', '.join(unknown)}"
            + (f"; did you mean {', '.join(close)}?" if close else "; `metapatch status` lists them"))
