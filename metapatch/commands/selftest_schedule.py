"""The schedule of ``metapatch selftest``: which scenarios run (chains), how many runs are in flight at once
(run_chains) and the progress on stderr (Progress). Rows are made and judged by metapatch.commands.selftest,
which hands its row functions to run_chains (a row is ``metapatch.commands.selftest.Row``)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence


def _decisive(row: Any) -> bool:
    """A row that shows this install's behaviour: a scenario that could not run here (n/a, a missing
    package) says nothing, and one whose bug did not show on this machine ("not reproduced") proves
    the fix on nothing, so the quick run goes on to the patch's next scenario."""
    return not row.not_applicable and row.verdict not in ("skipped", "not reproduced")


def chains(scenarios: Sequence[Any], quick: bool) -> List[List[Any]]:
    """Units of work. Quick: one chain per patch, run until one scenario is decisive: first the
    scenarios marked ``quick`` (the patch's representative: the cheapest that shows its bug and fix
    on the releases it was measured on), then the others in declared order; otherwise every scenario
    is its own chain and always runs."""
    if not quick:
        return [[s] for s in scenarios]
    by_patch: Dict[str, List[Any]] = {}
    for scenario in scenarios:
        by_patch.setdefault(scenario.patch_id, []).append(scenario)
    return [sorted(chain, key=lambda s: not getattr(s, "quick", False)) for chain in by_patch.values()]


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """A line on stderr per finished scenario: which, its verdict and time, how many chains (patches,
    in the quick run) are done of how many, the time so far and an estimate of the time left (the
    time so far per finished chain, times the chains left)."""

    def __init__(self, total: int, jobs: int, enabled: bool) -> None:
        self.total, self.jobs, self.enabled = total, jobs, enabled
        self.done, self.started = 0, time.perf_counter()

    def finished(self, row: Any, chain_done: bool, following: Optional[str] = None) -> None:
        self.done += chain_done
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        left = self.total - self.done
        estimate = f", about {_clock(elapsed / self.done * left)} left" if left and self.done else ""
        then = f"; next for this patch: {following}" if following else ""
        print(f"[{self.done}/{self.total}] {row.scenario}: {row.verdict} ({row.seconds:.0f} s{then}) "
              f"[{_clock(elapsed)} elapsed{estimate}]", file=sys.stderr, flush=True)


class _Chain:
    """One chain's place in the schedule: its current scenario, the runs of it not started yet, the
    outcomes back so far."""

    def __init__(self, scenarios: Sequence[Any]) -> None:
        self.scenarios, self.index, self.done = list(scenarios), -1, False
        self.row: Optional[Any] = None
        self.legs: List[str] = []
        self.running = 0
        self.outcomes: Dict[str, Any] = {}
        self.started = 0.0


def run_chains(work: List[List[Any]], quick: bool, jobs: int, registry: Any, timeout: float,
               on_row: Any, progress: Progress, start_row: Callable[..., Any], finish_row: Callable[..., Any]
               ) -> List[Any]:
    """Run the chains with ``jobs`` runs in flight at once (default 2: one per core). The unit is a
    run, not a scenario: a scenario's unpatched and patched runs go out at once, so no core waits
    while the other finishes a scenario's second run. In a chain, the next scenario starts only once
    the current one is judged (quick: only where it did not decide). Rows come back in the order the
    scenarios were given, whatever order they finished in."""
    from metapatch.selftest import run_scenario

    order = {s.key: (n, i) for n, chain in enumerate(work) for i, s in enumerate(chain)}
    states = [_Chain(chain) for chain in work]
    rows: List[Any] = []
    cond = threading.Condition()

    def advance(chain: _Chain) -> None:  # under cond: the chain's next scenario, or its end
        while True:
            chain.index += 1
            if chain.index >= len(chain.scenarios):
                chain.done = True
                return
            scenario = chain.scenarios[chain.index]
            chain.row = start_row(scenario, registry)
            if chain.row.verdict != "skipped":
                # Where the parent already knows the scenario is n/a here, its patched run is not
                # started; the child decides it again (the unpatched run reports n/a).
                chain.legs = ["unpatched"] + ([] if scenario.not_applicable_here() else ["patched"])
                chain.outcomes, chain.started = {}, time.perf_counter()
                return
            record(chain)  # skipped: it decides nothing, so on to the next

    def record(chain: _Chain) -> None:  # under cond
        row = chain.row
        rows.append(row)
        on_row(row)
        last = chain.index == len(chain.scenarios) - 1 or (quick and _decisive(row))
        following = None if last else chain.scenarios[chain.index + 1].name
        progress.finished(row, chain_done=last, following=following)

    def take() -> Optional[tuple]:  # under cond: the next run to start, None when all is done
        while True:
            for chain in states:
                if chain.done:
                    continue
                if chain.index < 0:
                    advance(chain)
                    if chain.done:
                        continue
                if chain.legs:
                    chain.running += 1
                    return chain, chain.scenarios[chain.index], chain.legs.pop(0)
            if all(chain.done for chain in states):
                return None
            cond.wait()

    def lane() -> None:
        while True:
            with cond:
                task = take()
            if task is None:
                return
            chain, scenario, leg = task
            outcome = run_scenario(scenario, patched=leg == "patched", timeout=timeout)
            with cond:
                chain.running -= 1
                chain.outcomes[leg] = outcome
                if leg == "unpatched":
                    if outcome.not_applicable is not None:
                        chain.legs = []  # not needed: n/a does not depend on metapatch
                    elif "patched" not in chain.legs and "patched" not in chain.outcomes and not chain.running:
                        chain.legs.append("patched")  # the parent thought n/a, the child ran it
                if not chain.running and not chain.legs:
                    finish_row(chain.row, chain.outcomes["unpatched"], chain.outcomes.get("patched"),
                               time.perf_counter() - chain.started)
                    record(chain)
                    if quick and _decisive(chain.row):
                        chain.done = True
                    else:
                        advance(chain)
                cond.notify_all()

    threads = [threading.Thread(target=lane, daemon=True) for _ in range(max(1, jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(rows, key=lambda r: (order[r.scenario], r.scenario))
