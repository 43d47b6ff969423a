"""Shipped reproducers: the single source for the tests, ``metapatch selftest`` and the checks of
the upstream diffs. Each scenario runs in a fresh subprocess so patched and unpatched runs never
share a process.

A scenario module (``metapatch/selftest/<patch_id with _>.py``) defines ``SCENARIOS``, a list of
:class:`Scenario`. A scenario function takes a working directory (empty, its own) and returns a
dict of measurements; it raises when the behaviour is wrong: the upstream error itself where the
bug bites, or an ``AssertionError`` when outputs differ from the in-memory reference. By
convention it reports ``max_abs_diff`` against that reference.
"""

from __future__ import annotations

from ._harness import Expect, Outcome, Scenario, all_scenarios, run_scenario, scenarios_for, unmet


class NotApplicable(Exception):
    """Raised by a scenario whose model class or API does not exist in the installed stack
    (``NotApplicable("needs transformers >= 5.5 (Gemma4ForCausalLM)")``). The harness reports the
    scenario as ``n/a`` with this message: it is neither a pass nor a failure, and it does not change
    ``metapatch selftest``'s exit code."""


__all__ = ["Expect", "NotApplicable", "Outcome", "Scenario", "all_scenarios", "run_scenario", "scenarios_for", "unmet"]
