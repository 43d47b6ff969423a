"""bnb-cpu-repack-copy: three-way proof per scenario, on the path this CPU takes.

Every scenario runs in its own interpreter and reports ``cpu_repack``: whether bitsandbytes
repacks 4-bit weights here (AVX512-BF16 and a release with the CPU repack). Where it does,
unpatched fails with upstream's symptom; where it does not, the tests assert that the portable
kernel ran and that upstream passes (nothing is repacked): no test is skipped for the CPU.
Legs: unpatched (METAPATCH_DISABLE=all), patched, this patch alone off (bnb-quant-state-offload
still on: the offloaded matrix), and the upstream diff on a copy of bitsandbytes with metapatch
disabled (for the offloaded matrix together with bnb-quant-state-offload's diff, which it needs).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Tuple

import pytest

import metapatch
from metapatch.diffs import APPLIES, apply_to_copy, check, diffs_for
from metapatch.patches.bnb_cpu_repack_copy import PATCH
from metapatch.patches.bnb_quant_state_offload import PATCH as OFFLOAD_PATCH
from metapatch.selftest import run_scenario, scenarios_for
from metapatch.selftest._harness import Outcome

AFFECTED = metapatch.registry.gate(PATCH).affected
SCENARIOS = {s.name: s for s in scenarios_for(PATCH.id)}
# mode -> (patched, METAPATCH_DISABLE, the patch ids whose diffs are applied, in order)
MODES = {
    "unpatched": (False, None, ()),
    "patched": (True, None, ()),
    "repack-patch-off": (True, PATCH.id, ()),
    "diff": (False, None, (PATCH.id,)),
    "diffs-with-offload": (False, None, (OFFLOAD_PATCH.id, PATCH.id)),
}
PLAN = {
    "training-after-eval": ("unpatched", "patched", "diff"),
    "save-after-forward": ("unpatched", "patched", "diff"),
    "offloaded-layer-matrix": ("repack-patch-off", "patched", "diffs-with-offload"),
    "dispatched-models": ("repack-patch-off", "patched", "diffs-with-offload"),
}
# The upstream symptom of each scenario on a CPU that repacks
SYMPTOMS = {
    "training-after-eval": ("grad None",),
    "save-after-forward": ("differ from what was loaded",),
    "offloaded-layer-matrix": ("N must be divisible by block_n", "is invalid for input of size"),
    "dispatched-models": ("is invalid for input of size",),  # the Llama with bfloat16 storage, first
}


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self.copies: Dict[Tuple[str, ...], Path] = {}
        self.pool = ThreadPoolExecutor(max_workers=int(os.environ.get("METAPATCH_TEST_WORKERS", "2")))
        self.futures: Dict[Tuple[str, str], object] = {}

    def _copy(self, ids: Tuple[str, ...]) -> Path:
        if ids not in self.copies:
            series = [d for pid in ids for d in diffs_for(pid)]
            self.copies[ids] = apply_to_copy(series, self.root / "diffs" / "+".join(ids))
        return self.copies[ids]

    def _run(self, name: str, mode: str) -> Tuple[Outcome, Path]:
        patched, disable, ids = MODES[mode]
        cwd = self.root / "cwd" / f"{name}-{mode}"
        cwd.mkdir(parents=True)
        pythonpath = [str(self._copy(ids))] if ids else []
        env = {"METAPATCH_DISABLE": disable} if disable else None
        return run_scenario(SCENARIOS[name], patched=patched, env=env, pythonpath=pythonpath, cwd=str(cwd)), cwd

    def get(self, name: str, mode: str) -> Outcome:
        if MODES[mode][2] and not AFFECTED:
            pytest.skip(f"{mode}: the installed bitsandbytes has no CPU repack (not affected), no diff to apply")
        series = [d for pid in MODES[mode][2] for d in diffs_for(pid)]
        for n, diff in enumerate(series):
            verdict = check(diff, previous=series[:n])
            if verdict.verdict != APPLIES:  # written against bitsandbytes main (0.50.x code)
                pytest.skip(f"{diff.path.parent.name}/{diff.path.name} does not apply to the installed "
                            f"bitsandbytes {verdict.installed}: {verdict.verdict}")
        if (name, mode) not in self.futures:
            self.futures[(name, mode)] = self.pool.submit(self._run, name, mode)
        outcome, cwd = self.futures[(name, mode)].result()
        assert list(cwd.iterdir()) == [], f"{name}/{mode} wrote into the working directory: {list(cwd.iterdir())}"
        if outcome.not_applicable:
            pytest.skip(f"{name} is n/a here: {outcome.not_applicable}")
        return outcome

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    started = Runs(tmp_path_factory.mktemp("bnb-cpu-repack"))
    yield started
    started.close()


def _explain(outcome: Outcome) -> str:
    return f"{outcome.error_type}: {outcome.error}\n{outcome.traceback[-3000:]}\n{outcome.stderr_tail[-1500:]}"


def _passed(outcome: Outcome) -> Dict:
    assert outcome.passed, _explain(outcome)
    assert outcome.metrics["max_abs_diff"] == 0.0
    assert isinstance(outcome.metrics["cpu_repack"], bool)
    # the gate and the CPU agree: a release without the repack never reports the repack path
    assert AFFECTED or not outcome.metrics["cpu_repack"]
    return outcome.metrics


def _cpu_repacks(runs) -> bool:
    """Whether this CPU takes the repack path, as the patched child measured it."""
    return _passed(runs.get("training-after-eval", "patched"))["cpu_repack"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "dispatched-models" else n
                                  for n in sorted(PLAN)])  # the real models: slow, the layer matrix is not
def test_without_this_patch(runs, name):
    mode = PLAN[name][0]
    outcome = runs.get(name, mode)
    if AFFECTED and _cpu_repacks(runs):
        assert not outcome.passed, f"{name} passed {mode} on a CPU that repacks"
        assert outcome.error_type == SCENARIOS[name].expected_error, _explain(outcome)
        assert any(symptom in outcome.error for symptom in SYMPTOMS[name]), outcome.error
    else:
        # the portable kernel only (no AVX512-BF16, or a release without the repack): upstream is right
        assert _passed(outcome)["cpu_repack"] is False
    if mode == "unpatched":
        assert set(outcome.states.values()) == {"disabled"}
    else:
        assert outcome.states[PATCH.id] == "disabled"


@pytest.mark.parametrize("name", sorted(PLAN))
def test_patched(runs, name):
    outcome = runs.get(name, "patched")
    metrics = _passed(outcome)
    assert outcome.states[PATCH.id] == ("applied" if AFFECTED else "not-affected")
    assert metrics["cpu_repack"] == _cpu_repacks(runs)
    if name == "offloaded-layer-matrix":
        assert metrics["cases"] == 24 or not AFFECTED, metrics  # 12 combinations x disk/cpu offload
        # a cpu-offloaded layer is repacked once per load of its source, not at every forward
        assert metrics["repacks_at_second_forward"] == 0, metrics
    if name == "save-after-forward":
        assert metrics["files_compared"] >= 1  # 2 where bitsandbytes quantizes fp4 on the CPU (>= 0.47)
    if name == "dispatched-models":
        assert metrics["llama_bfloat16_storage"] == 1
        # Gemma 4 needs transformers >= 5.5: said in the result where it is missing
        assert metrics["gemma4_uint8_storage"] == 1 or metrics["gemma4_uint8_storage"].startswith("n/a: "), metrics


def test_patched_inference_is_upstreams(runs):
    """The eval forward before training gives the very logits upstream gives (the repacked kernel
    where the CPU has it): the patch moves the repack, it does not change what it computes."""
    patched = runs.get("training-after-eval", "patched").metrics["eval_logits_sha256"]
    unpatched = runs.get("training-after-eval", "unpatched")
    if unpatched.passed:
        assert unpatched.metrics["eval_logits_sha256"] == patched
    else:
        assert f"[eval logits sha256 {patched}]" in unpatched.error, unpatched.error


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLAN))
def test_upstream_diff_alone_fixes(runs, name):
    outcome = runs.get(name, PLAN[name][2])
    _passed(outcome)
    assert set(outcome.states.values()) == {"disabled"}
