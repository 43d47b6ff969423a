"""FSDP loading on two real ranks (gloo on CPU): the harness itself, then the three-way proof of
fsdp-rank-placeholders, accelerate-fsdp2-plain-buffers, accelerate-fsdp2-adapter-state and
peft-tp-shard-import. Every test here spawns ranks (marker ``ranks``); the upstream-diff legs, the
training guard and the fixed-release guards are also ``slow``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import metapatch
from metapatch.patches.accelerate_fsdp2_adapter_state import PATCH as ADAPTER_STATE
from metapatch.patches.accelerate_fsdp2_plain_buffers import PATCH as PLAIN_BUFFERS
from metapatch.patches.accelerate_fsdp2_shared_embeddings import PATCH as SHARED_EMBEDDINGS
from metapatch.patches.fsdp_rank_placeholders import PATCH as PLACEHOLDERS
from metapatch.patches.peft_tp_shard_import import PATCH as TP_IMPORT
from metapatch.selftest import run_scenario, scenarios_for
from metapatch.selftest._ranks import raise_first_error, run_ranks

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

pytestmark = pytest.mark.ranks
PATCHES = {p.id: p for p in (PLACEHOLDERS, PLAIN_BUFFERS, ADAPTER_STATE, TP_IMPORT, SHARED_EMBEDDINGS)}
def _fixed_upstream_here(scenario):
    """A scenario whose own bug an upstream release inside the patch's range already fixed: the
    tied causal LM on accelerate 1.15 (huggingface/accelerate#4171; BART's tie is still open there)."""
    from importlib.metadata import version

    from packaging.version import Version

    return scenario.name == "tied-causal-lm" and Version(version("accelerate")) >= Version("1.15")
CASES = [s for p in PATCHES for s in scenarios_for(p)]


# -- the harness: ranks really form one group, and a failing rank is reported, not waited for ----

# The ranks import this module by its name: its folder goes on their path.
HERE_ON_PATH = {"PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)}

def _sum_of_ranks(rank, world_size, workdir):
    import torch
    import torch.distributed as dist

    from metapatch.selftest._ranks import backend

    dist.init_process_group(backend())
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {"sum": float(value), "cwd": os.getcwd()}


def _rank1_fails(rank, world_size, workdir):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        raise KeyError("rank one's own error")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: the harness must not wait for its timeout


def test_ranks_form_one_group(tmp_path):
    reports = run_ranks(f"{__name__}:_sum_of_ranks", tmp_path, timeout=600, env=HERE_ON_PATH)
    raise_first_error(reports)
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["result"]["sum"] for r in reports] == [3.0, 3.0]  # 1 + 2, seen by both
    assert {r["result"]["cwd"] for r in reports} == {str(tmp_path)}


def test_failing_rank_is_reported_with_its_error(tmp_path):
    reports = run_ranks(f"{__name__}:_rank1_fails", tmp_path, timeout=600, env=HERE_ON_PATH)
    assert reports[1]["ok"] is False and reports[1]["error_type"] == "KeyError"
    assert reports[0]["ok"] is False
    with pytest.raises(Exception) as raised:
        raise_first_error(reports)
    assert type(raised.value).__name__ == "KeyError" and "rank 1" in str(raised.value)


# -- three-way proof (the upstream errors, in their own words, are on the scenarios) -----------------

def _gate(scenario):
    return metapatch.registry.gate(PATCHES[scenario.patch_id])


def _claimed(scenario) -> None:
    affected, why, _, _ = _gate(scenario)
    if not affected:
        pytest.skip(f"{scenario.patch_id} does not claim this stack ({why}); its range is what was measured")


class TestThreeWay(ThreeWayCase):
    """Only where each patch's range holds (outside it the two-rank flows are other code variants,
    measured by test_fixed_release_passes_unpatched); the diff legs are slow."""

    patch_ids = tuple(PATCHES)

    @classmethod
    def scenarios(cls):
        return [s for s in super().scenarios() if s.expected_error]  # train-step-new-head: its own test

    def check_unpatched(self, scenario, outcome):
        if scenario.patch_id == PLACEHOLDERS.id:
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

    def test_unpatched(self, runs, scenario):
        if _fixed_upstream_here(scenario):
            pytest.skip("accelerate >= 1.15 groups the input and output embeddings itself (#4171); "
                        "test_patched still runs it")
        _claimed(scenario)
        super().test_unpatched(runs, scenario)

    def test_patched(self, runs, scenario):
        _claimed(scenario)
        super().test_patched(runs, scenario)

    @pytest.mark.slow
    def test_upstream_diff_alone(self, runs, scenario):
        _claimed(scenario)
        super().test_upstream_diff_alone(runs, scenario)


@pytest.mark.slow
def test_training_flow_unchanged():
    """accelerate's own FSDP2 prepare already broadcasts rank 0's weights: the patched step, the
    checkpoint and its reload stay equal to one process."""
    (scenario,) = [s for s in CASES if s.name == "train-step-new-head"]
    outcome = run_scenario(scenario, patched=True)
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["step_change"] > 0 and outcome.metrics["max_abs_diff"] <= 1e-5, outcome.metrics


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s for s in CASES if s.patch_id in (ADAPTER_STATE.id, TP_IMPORT.id)],
                         ids=lambda s: s.key)
def test_fixed_release_passes_unpatched(scenario):
    """Outside these patches' ranges the upstream fix is what was measured (accelerate 1.15 for the
    adapter save, peft 0.20 for the import): the same two-rank flow passes without metapatch."""
    affected, why, _, _ = _gate(scenario)
    if affected:
        pytest.skip(f"{scenario.patch_id} claims this stack; test_unpatched covers it")
    outcome = run_scenario(scenario, patched=False)
    if outcome.not_applicable:
        pytest.skip(outcome.not_applicable)
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["max_abs_diff"] == 0, outcome.metrics
