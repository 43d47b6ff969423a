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
        if scenario.name == "loading-flows-ranks":
            check_loading_flows_unpatched(outcome.error)

    def check_patched(self, scenario, outcome):
        if scenario.name == "loading-flows-ranks":  # rank 1's new head is a placeholder until prepare: refused
            assert outcome.metrics["rank1_new-head_early"] == "refused", outcome.metrics
            # T5 misses no key: rank 1 read the checkpoint (5.23+) or holds zeros in its place (refused), never
            # answers with them
            assert {outcome.metrics[f"rank{r}_{f}_early"] for r in (0, 1) for f in ("fp16", "bf16")} <= \
                {"equal", "refused"}, outcome.metrics
        if scenario.name == "eval-only-new-head":
            # used before prepare: rank 0's model is right, rank 1 refuses instead of using its placeholders
            assert outcome.metrics["rank0_early"] == "equal" and outcome.metrics["rank1_early"] == "refused", \
                outcome.metrics

    def check_diff(self, scenario, outcome):
        if scenario.name == "eval-only-new-head":
            # the diff broadcasts at prepare_model but does not refuse an earlier use (transformers would
            # have to mark its placeholders; the runtime patch does): pinned, so the difference stays known
            assert outcome.metrics["rank1_early"] == "differs", outcome.metrics


def check_loading_flows_unpatched(error):
    """Without metapatch only rank 1's evaluation-only new head is wrong; accelerate's training prepare
    broadcasts it, and from transformers 5.23 (rank 1 reads the checkpoint too) the half-precision T5 loads are
    right upstream: there they are regression checks that hold without metapatch as with it."""
    from importlib.metadata import version

    from packaging.version import Version

    assert "rank 0 " not in error and "new-head after train prepare" not in error, error
    assert "'rank1_new-head_train_state_diff': 0.0" in error and "'rank1_new-head_train_logits_diff': 0.0" in error
    if Version(version("transformers")) >= Version("5.23"):
        for key in ("fp16_eval_state_diff", "fp16_eval_logits_diff", "bf16_eval_state_diff", "bf16_eval_logits_diff"):
            assert f"'rank1_{key}': 0.0" in error, error
        assert "rank 1 fp16" not in error and "rank 1 bf16" not in error, error


@pytest.mark.slow
def test_training_flow_unchanged():
    """accelerate's own FSDP2 prepare already broadcasts rank 0's weights: the patched step, the
    checkpoint and its reload stay equal to one process."""
    from metapatch.selftest import run_scenario, scenarios_for

    (scenario,) = [s for s in scenarios_for(PATCH.id) if s.name == "train-step-new-head"]
    outcome = run_scenario(scenario, patched=True)
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["step_change"] > 0 and outcome.metrics["max_abs_diff"] <= 1e-5, outcome.metrics
