"""fsdp-rank-placeholders: three-way proof on two real ranks (gloo on CPU): a model loaded on rank 0 only
keeps placeholders on the other ranks until accelerate's FSDP2 prepare broadcasts it."""

from __future__ import annotations

import pytest

from metapatch.patches.fsdp_rank_placeholders import PATCH

from _fsdp_three_way import FsdpThreeWay  # tests/patches/_fsdp_three_way.py

pytestmark = pytest.mark.ranks


class TestThreeWay(FsdpThreeWay):
    patch_ids = (PATCH.id,)

    def check_unpatched(self, scenario, outcome):
        assert "'rank1_logits_diff': 0.0" not in outcome.error  # rank 0 is right, rank 1 differs

    def check_patched(self, scenario, outcome):
        if scenario.name == "eval-only-new-head":
            # used before prepare: rank 0's model is right, rank 1 refuses instead of using its placeholders
            assert outcome.metrics["rank0_early"] == "equal" and outcome.metrics["rank1_early"] == "refused", \
                outcome.metrics

    def check_diff(self, scenario, outcome):
        if scenario.name == "eval-only-new-head":
            # the diff broadcasts at prepare_model but does not refuse an earlier use (transformers would
            # have to mark its placeholders; the runtime patch does): pinned, so the difference stays known
            assert outcome.metrics["rank1_early"] == "differs", outcome.metrics


@pytest.mark.slow
def test_training_flow_unchanged():
    """accelerate's own FSDP2 prepare already broadcasts rank 0's weights: the patched step, the
    checkpoint and its reload stay equal to one process."""
    from metapatch.selftest import run_scenario, scenarios_for

    (scenario,) = [s for s in scenarios_for(PATCH.id) if s.name == "train-step-new-head"]
    outcome = run_scenario(scenario, patched=True)
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["step_change"] > 0 and outcome.metrics["max_abs_diff"] <= 1e-5, outcome.metrics
