"""The flows a CUDA machine must keep holding, on GPU 0 (skipped, with the reason, without one).

Each test runs shipped selftest scenarios in their own processes, as ``metapatch selftest`` does: on a
machine with CUDA they compute on ``cuda:0`` (GPU 0 in the device map, the offloaded rest on cpu/disk;
the in-memory reference on the same GPU, so outputs are compared exactly), and the two-rank scenarios
stay pinned to the CPU with CUDA hidden from their ranks. What each asserts holds by construction on any
number of GPUs (``count=1`` is the least they need): the outcome's device, the scenario's own comparison
with the in-memory GPU model, and the flow's particular facts (``model.device``, the map's devices).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import metapatch
from metapatch.selftest import _device, run_scenario
from metapatch.selftest._harness import find

pytestmark = pytest.mark.gpu(count=1)

REPO = Path(__file__).resolve().parents[1]


def _explain(outcome) -> str:
    return f"{outcome.error_type}: {outcome.error}\n{outcome.traceback[-3000:]}\n{outcome.stderr_tail[-1500:]}"


def _on_gpu(key: str, tmp_path: Path, patched: bool = True):
    """The scenario run as the selftest runs it, on a machine with CUDA: it must say it computed on cuda:0."""
    scenario = find(key)
    cwd = tmp_path / ("patched" if patched else "unpatched")
    cwd.mkdir()
    outcome = run_scenario(scenario, patched=patched, cwd=str(cwd))
    if outcome.not_applicable:
        pytest.skip(f"{key}: n/a here: {outcome.not_applicable}")
    assert outcome.device == "cuda:0" and outcome.device_note is None, (outcome.device, _explain(outcome))
    assert list(cwd.iterdir()) == [], f"{key} wrote into its working directory"
    return scenario, outcome


def _affected(scenario) -> bool:
    return metapatch.registry.gate(metapatch.registry.patches[scenario.patch_id]).affected


# Every flow of the GPU record: model.device with the embedding on disk; PEFT and transformers' adapter
# loading over a GPU/cpu/disk base; the tied DiffusionGemma under device_map="auto" at small and moderate
# budgets split between GPU 0 and the CPU; .to(<GPU>, dtype) of an offloaded model; accelerate's
# tied-embeddings recipe with disk layers.
FLOWS = {
    "offloaded-model-device/generate-embedding-on-disk": {"model_device": "cuda:0", "inner_model_device": "cuda:0"},
    "peft-offload-redispatch/llama": {},
    "transformers-load-adapter-offload/load-adapter-offloaded": {},
    "tied-device-map-transformers/auto-map-small-budget": {},
    # half the moderate budget on GPU 0, half on the CPU: GPU 0, cpu and disk in the map (simulated on the CPU
    # by tests/patches/test_tied_device_map_transformers.py::test_gpu_budgets_simulated_on_the_cpu), computing on GPU 0
    "tied-device-map-transformers/auto-map-moderate-budget": {"computed_on": "cuda:0", "devices": ["0", "cpu", "disk"]},
    "offloaded-dtype-conversion/to-own-device-and-dtype-layers-on-disk": {"dtype": "torch.float16"},
    "accelerate-tie-before-load/dispatch-cpu-disk-map": {"head_tied": True},
    # 4-bit layers on disk and on cpu under an inferred map, quantized on GPU 0 like the in-memory model
    "transformers-quantized-disk-weights/auto-map-generate-save": {"generated_tokens": 8},
    "transformers-quantized-disk-weights/prequantized-checkpoint": {},
    # writes into offloaded weights with operands on GPU 0 (a 0-dim scale, an index tensor), replayed on the stored
    # value in CPU memory, and a weight replaced by a tensor on GPU 0; the in-memory reference is on GPU 0
    "offloaded-placeholder-writes/in-place-edits": {"refused": ""},
    "offloaded-placeholder-writes/replaced-weights": {"refused": ""},
}


@pytest.mark.parametrize("key", sorted(FLOWS))
def test_patched_flow_equals_the_in_memory_gpu_model(key, tmp_path):
    scenario, outcome = _on_gpu(key, tmp_path)
    assert outcome.passed, _explain(outcome)
    assert outcome.metrics["max_abs_diff"] <= scenario.tolerance_on(outcome.device), outcome.metrics
    for name, value in FLOWS[key].items():
        assert outcome.metrics[name] == value, (name, outcome.metrics)
    if key.startswith("tied-device-map-transformers/"):
        # The budget is split between GPU 0 and the CPU (_device.memory_budget): what fits nowhere is on disk.
        assert "disk" in outcome.metrics["devices"], outcome.metrics


# (scenario, whether its upstream error class is asserted): the tied map's budget split between GPU 0 and the
# CPU is not the CPU's budget, so where inference first trips over the tied pair is not measured there.
UNPATCHED = {"offloaded-model-device/generate-embedding-on-disk": True,
             "tied-device-map-transformers/auto-map-small-budget": False,
             "transformers-quantized-disk-weights/auto-map-generate-save": True}


@pytest.mark.parametrize("key", sorted(UNPATCHED))
def test_unpatched_flow_shows_the_bug_on_the_gpu_too(key, tmp_path):
    scenario, outcome = _on_gpu(key, tmp_path, patched=False)
    if not _affected(scenario):
        pytest.skip(f"{scenario.patch_id} is not affected on this install")
    assert not outcome.passed, f"{key} passed without metapatch on the GPU"
    assert "CUDA error" not in (outcome.error or "") and "re-initialize CUDA" not in (outcome.error or ""), \
        _explain(outcome)
    if UNPATCHED[key]:
        expect = scenario.expected_unpatched(True, device=outcome.device)
        assert outcome.error_type in expect.error.split("|"), _explain(outcome)


def test_dispatched_model_moves_to_its_own_gpu(tmp_path):
    """``.to("cuda:0")`` of a model loaded with GPU 0 and disk in its map: nothing moves (the execution device
    is cuda:0 already), the disk layers stay offloaded, and the outputs equal the in-memory GPU model's."""
    import torch
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import input_ids, save_tiny_llama

    path = save_tiny_llama(tmp_path / "ckpt")
    reference = LlamaForCausalLM.from_pretrained(path).eval().to("cuda:0")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                  "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": 0, "lm_head": 0}
    model = LlamaForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "off")).eval()
    assert model.to("cuda:0") is model
    assert model.model.layers[2].self_attn.q_proj.weight.is_meta
    assert model.device == torch.device("cuda:0")
    ids = input_ids().to("cuda:0")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        kwargs = dict(max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_two_rank_scenario_stays_on_the_cpu_with_cuda_hidden(tmp_path):
    """A two-rank gloo scenario on a GPU machine: pinned to the CPU (its process and ranks see no CUDA), it
    reproduces as on a CPU-only machine, never with a CUDA initialisation error."""
    key = "accelerate-fsdp2-shared-embeddings/bart-three-way-tie"
    scenario = find(key)
    outcome = run_scenario(scenario, patched=True, cwd=str(tmp_path))
    assert (outcome.device, outcome.device_note) == ("cpu", scenario.device_reason), _explain(outcome)
    assert outcome.passed, _explain(outcome)
    unpatched = run_scenario(scenario, patched=False, cwd=str(tmp_path))
    assert "CUDA" not in (unpatched.error or ""), _explain(unpatched)
    expect = scenario.expected_unpatched(_affected(scenario), device="cpu")
    if expect.error:
        assert unpatched.error_type in expect.error.split("|"), _explain(unpatched)
    else:
        assert unpatched.passed, _explain(unpatched)


def test_selftest_reports_each_scenarios_device_and_exits_0(tmp_path):
    """``metapatch selftest`` on a GPU machine: a scenario on GPU 0 and a pinned two-rank one, both reported
    with their device; bitsandbytes is left out of the warm parents (it initialises CUDA at import)."""
    keys = ["offloaded-model-device/generate-embedding-on-disk", "accelerate-fsdp2-plain-buffers/persistent-buffer-prepare"]
    args = [sys.executable, "-m", "metapatch.cli", "selftest", "--json", *(f"--scenario={k}" for k in keys)]
    env = {k: v for k, v in os.environ.items() if k not in ("METAPATCH_DISABLE", _device.DEVICE_ENV)}
    done = subprocess.run(args, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    data = json.loads(done.stdout)
    rows = {row["scenario"]: row for row in data["rows"]}
    assert done.returncode == data["exit_code"] == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert rows[keys[0]]["device"] == "cuda:0" and rows[keys[0]]["device_note"] is None
    assert rows[keys[1]]["device"] == "cpu" and "gloo" in rows[keys[1]]["device_note"]
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        assert "bitsandbytes imported by each run" in done.stderr, done.stderr[-2000:]
