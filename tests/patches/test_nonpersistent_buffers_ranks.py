"""empty-built-nonpersistent-buffers on two real ranks (gloo on CPU), FSDP cpu_ram_efficient_loading:
rank 0 gets empty_like memory and ranks != 0 zeros_like for a buffer _init_weights does not recompute;
fsdp-rank-placeholders then broadcasts rank 0's copy. Three legs: unpatched every rank differs from the
in-memory model, patched every rank equals it after load and after prepare, the transformers diff alone
too. Marked ``ranks`` and ``slow`` (two interpreters per leg)."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.empty_built_nonpersistent_buffers import PATCH
from metapatch.selftest import run_scenario, scenarios_for

from _three_way import assert_equals_reference, upstream_diff_copy

pytestmark = [pytest.mark.ranks, pytest.mark.slow]
SCENARIO = next(s for s in scenarios_for(PATCH.id) if s.name == "fsdp-ranks-buffer")
AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


def _skip_na(outcome):
    if outcome.not_applicable is not None:
        pytest.skip(f"n/a on this stack: {outcome.not_applicable}")


def test_unpatched_ranks_disagree_with_the_model():
    outcome = run_scenario(SCENARIO, patched=False)
    _skip_na(outcome)
    if not AFFECTED:
        pytest.skip(f"not affected here: {WHY}")
    assert not outcome.passed and outcome.error_type == "AssertionError", outcome.traceback
    # rank 0: empty_like (NaN sentinel) memory; rank 1: zeros_like; neither is the constructor's value
    assert "'rank0_loaded_equal': False" in outcome.error and "'rank1_loaded_equal': False" in outcome.error


def test_patched_every_rank_equals_the_model():
    outcome = run_scenario(SCENARIO, patched=True)
    _skip_na(outcome)
    assert_equals_reference(outcome)
    assert all(outcome.metrics[f"rank{r}_{k}_equal"] for r in (0, 1) for k in ("loaded", "prepared", "logits"))
    if AFFECTED:
        assert outcome.states[PATCH.id] == "applied"


def test_upstream_diff_alone(tmp_path_factory):
    from importlib.metadata import version

    from packaging.version import Version

    outcome = run_scenario(SCENARIO, patched=False, pythonpath=[upstream_diff_copy(PATCH.id, tmp_path_factory)])
    _skip_na(outcome)
    if outcome.passed or Version(version("transformers")) >= Version("5.23"):
        assert_equals_reference(outcome)
        return
    # transformers < 5.23 gives rank 1 zeros for every weight until an FSDP prepare; the evaluation-only
    # prepare does not broadcast them upstream (fsdp-rank-placeholders' accelerate diff, not this one).
    # The buffers themselves must still be right on every rank.
    assert outcome.error_type == "AssertionError", outcome.traceback
    for rank in (0, 1):
        for key in ("loaded", "prepared"):
            assert f"'rank{rank}_{key}_equal': True" in outcome.error, outcome.error
    assert "'rank0_logits_equal': True" in outcome.error, outcome.error
