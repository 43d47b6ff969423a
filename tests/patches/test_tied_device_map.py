"""Tied-weight-aware device maps (DiffusionGemma's regex-tied encoder/decoder): proof per scenario.

Subprocess runs (metapatch.selftest.tied_device_map), each unpatched, patched, and with the upstream
diff of the package it concerns applied to a copy of the installed package. Which releases are
affected is read from the installed versions:
* the moderate-budget load: the whole model goes to disk and is never dispatched on transformers
  5.11-5.12 only (PR #46625, 5.13, fixed the count);
* the small-budget IndexError, the explicit map splitting a tied group, and the budget sweeps: every
  release with DiffusionGemma up to the latest checked.
In-process checks of the map functions cover the full-size 26B-A4B config on meta (simulated GPU
budgets, no CUDA needed) and a comparison with transformers' own map where it succeeds.
transformers 5.7 has no DiffusionGemma: those checks skip, saying so.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Tuple

import pytest

import metapatch
from metapatch import _tied_groups as tg
from metapatch.diffs import _as_package_relative, _run_patch, apply_to_copy, diffs_for
from metapatch.patches.diffusion_gemma_offloaded_embeddings import PATCH as EMBED_PATCH
from metapatch.patches.tied_device_map_accelerate import PATCH as ACC_PATCH
from metapatch.patches.tied_device_map_disk_index import PATCH as INDEX_PATCH
from metapatch.patches.tied_device_map_meta_pointer import PATCH as POINTER_PATCH
from metapatch.patches.tied_device_map_transformers import PATCH as TF_PATCH
from metapatch.selftest import run_scenario
from metapatch.selftest import tied_device_map as sc
from metapatch.selftest._harness import Outcome

HAS_MODEL = sc.has_diffusion_gemma()
NO_MODEL = "transformers has no DiffusionGemma (it arrived in 5.11): the DiffusionGemma scenarios do not apply"
needs_model = pytest.mark.skipif(not HAS_MODEL, reason=NO_MODEL)

GATE = {p.id: metapatch.registry._gate(p)[0] for p in (TF_PATCH, ACC_PATCH, INDEX_PATCH, POINTER_PATCH, EMBED_PATCH)}
SCENARIOS = {s.key: s for s in sc.SCENARIOS}


def _version(dist: str):
    import importlib.metadata

    from packaging.version import Version

    return Version(importlib.metadata.version(dist))


def _whole_model_to_disk_release() -> bool:
    from packaging.version import Version

    return Version("5.11") <= _version("transformers") < Version("5.13.0.dev0")


def unpatched_error(key: str) -> str:
    """What the scenario raises without metapatch on the installed versions ('' = passes)."""
    if key == "tied-device-map-transformers/auto-map-moderate-budget":
        return "RuntimeError" if _whole_model_to_disk_release() else ""  # generate() on meta tensors, the seed
    patch_id = key.split("/")[0]
    return SCENARIOS[key].expected_error if GATE[patch_id] else ""


# mode -> (patched, package whose diff is applied)
MODES = {"unpatched": (False, None), "patched": (True, None), "diff": (False, "diff")}
DIFF_OF = {TF_PATCH.id: TF_PATCH.id, ACC_PATCH.id: ACC_PATCH.id}


def _diff_fixes_alone(key: str) -> Tuple[bool, str]:
    """Whether the scenario's upstream diff can fix it on its own in this environment."""
    patch_id = key.split("/")[0]
    if not GATE[patch_id]:
        return False, "the installed version is not affected"
    if patch_id == TF_PATCH.id and key != "tied-device-map-transformers/budget-sweep":
        if GATE[INDEX_PATCH.id] or GATE[POINTER_PATCH.id]:
            return False, ("loading also needs fixes upstream already has (disk index in transformers 5.24, "
                           "meta pointer in accelerate 1.15): the diff targets the latest releases")
    return True, ""


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self.copies: Dict[str, Path] = {}
        self.not_applicable: Dict[str, str] = {}
        for patch_id in (TF_PATCH.id, ACC_PATCH.id):
            if GATE[patch_id]:
                (diff,) = diffs_for(patch_id)
                try:
                    self.copies[patch_id] = apply_to_copy(diff, root / "diffs" / patch_id)
                except RuntimeError as exc:  # written against the latest release; older code differs
                    self.not_applicable[patch_id] = f"the diff does not apply to the installed release: {exc}"[:400]
        if TF_PATCH.id in self.copies and GATE[EMBED_PATCH.id]:
            # The transformers side is two diffs (device maps; DiffusionGemma's embedding read): both go
            # into the same copy, as they would into one transformers checkout.
            (embed_diff,) = diffs_for(EMBED_PATCH.id)
            applied = _run_patch(_as_package_relative(embed_diff), self.copies[TF_PATCH.id])
            assert applied.returncode == 0, applied.stdout + applied.stderr
        workers = int(os.environ.get("METAPATCH_TEST_WORKERS", "2"))
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.futures = {}
        for key in SCENARIOS:
            for mode in MODES:
                if mode == "diff" and (not _diff_fixes_alone(key)[0] or DIFF_OF[key.split("/")[0]] not in self.copies):
                    continue
                self.futures[(key, mode)] = self.pool.submit(self._run, key, mode)

    def _run(self, key: str, mode: str) -> Tuple[Outcome, Path]:
        patched, diff = MODES[mode]
        cwd = self.root / "cwd" / f"{key.replace('/', '-')}-{mode}"
        cwd.mkdir(parents=True)
        pythonpath = [str(self.copies[DIFF_OF[key.split("/")[0]]])] if diff else []
        return run_scenario(SCENARIOS[key], patched=patched, pythonpath=pythonpath, cwd=str(cwd)), cwd

    def get(self, key: str, mode: str) -> Outcome:
        if (key, mode) not in self.futures:
            why = _diff_fixes_alone(key)[1] or self.not_applicable.get(DIFF_OF[key.split("/")[0]], "")
            pytest.skip(f"{mode} does not apply: {why}")
        outcome, cwd = self.futures[(key, mode)].result()
        assert list(cwd.iterdir()) == [], f"{key}/{mode} wrote into the working directory"
        return outcome

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not HAS_MODEL:
        pytest.skip(NO_MODEL)
    started = Runs(tmp_path_factory.mktemp("tied-device-map"))
    yield started
    started.close()


def _explain(outcome: Outcome) -> str:
    return f"{outcome.error_type}: {outcome.error}\n{outcome.traceback[-3000:]}\n{outcome.stderr_tail[-1500:]}"


@pytest.mark.parametrize("key", sorted(SCENARIOS))
def test_unpatched(runs, key):
    outcome = runs.get(key, "unpatched")
    expected = unpatched_error(key)
    if expected:
        assert not outcome.passed, f"{key} passed without metapatch on an affected version"
        assert outcome.error_type == expected, _explain(outcome)
        if key.endswith("auto-map-small-budget"):
            assert "list index out of range" in outcome.error
        if key.endswith("explicit-map-split-group"):
            assert "weight is on the meta device" in outcome.error
        if expected == "RuntimeError":  # never dispatched: generate() meets meta tensors
            assert "meta" in outcome.error and ("Tensor.item()" in outcome.error or "device meta" in outcome.error)
    else:
        assert outcome.passed, _explain(outcome)
    assert set(outcome.states.values()) == {"disabled"}


@pytest.mark.parametrize("key", sorted(SCENARIOS))
def test_patched(runs, key):
    outcome = runs.get(key, "patched")
    assert outcome.passed, _explain(outcome)
    assert outcome.metrics["max_abs_diff"] <= sc.LOGITS_TOLERANCE
    for patch_id, affected in GATE.items():
        assert outcome.states[patch_id] == ("applied" if affected else "not-affected"), (patch_id, outcome.states)


def test_patched_explicit_map_warns_naming_the_pair(runs):
    metrics = runs.get("tied-device-map-transformers/explicit-map-split-group", "patched").metrics
    assert metrics["warned_pairs"], metrics
    assert "model.encoder.language_model" in metrics["warning"] and "model.decoder" in metrics["warning"]


def test_patched_loads_dispatch_across_cpu_and_disk(runs):
    for key in ("tied-device-map-transformers/auto-map-moderate-budget",
                "tied-device-map-transformers/auto-map-small-budget"):
        assert "disk" in runs.get(key, "patched").metrics["devices"]


@pytest.mark.parametrize("key", sorted(SCENARIOS))
def test_upstream_diff_alone_fixes(runs, key):
    outcome = runs.get(key, "diff")
    assert outcome.passed, _explain(outcome)
    assert outcome.metrics["max_abs_diff"] <= sc.LOGITS_TOLERANCE


# ---------------------------------------------------------------------------------------------
# In-process: the map functions themselves (metapatch is imported, so they are the patched ones)


@pytest.fixture(scope="module")
def full_size_model():
    if not HAS_MODEL:
        pytest.skip(NO_MODEL)
    return sc.meta_model(sc.full_size_config())


GiB = 1 << 30


@needs_model
def test_full_size_config_is_the_26b_a4b_shape(full_size_model):
    groups = tg.tied_groups(full_size_model)
    total = sc.model_bytes(full_size_model)
    params = sum(p.numel() for p in full_size_model.parameters())
    assert 24e9 < params < 28e9, params  # 25.2B text + ~0.55B vision, encoder stack tied to the decoder
    assert len(groups) >= 600  # the issue measured 628 tied pairs
    assert total > 45 * GiB


@needs_model
@pytest.mark.parametrize("gpus", [2, 0])
def test_full_size_budgets(full_size_model, gpus):
    from transformers.integrations.accelerate import infer_auto_device_map

    total = sc.model_bytes(full_size_model)
    if gpus:
        budgets = [{0: 44 * GiB, 1: 44 * GiB, "cpu": 64 * GiB}, {0: 20 * GiB, 1: 20 * GiB, "cpu": 16 * GiB},
                   {0: 2 * GiB, 1: 2 * GiB, "cpu": 8 * GiB}]
    else:
        budgets = sc.budget_grid(total, (1.2, 0.5, 0.05), 0)
    problems = sc.sweep_budgets(full_size_model, infer_auto_device_map, budgets,
                                no_split_module_classes=full_size_model._no_split_modules)
    assert problems == []


@needs_model
def test_full_size_two_44gib_gpus_hold_the_model(full_size_model):
    from transformers.integrations.accelerate import infer_auto_device_map

    device_map = infer_auto_device_map(full_size_model, max_memory={0: 44 * GiB, 1: 44 * GiB, "cpu": 64 * GiB},
                                       no_split_module_classes=full_size_model._no_split_modules)
    used = tg.bytes_per_device(full_size_model, device_map)
    assert set(used) <= {0, 1}, used  # ~48 GiB once the tied encoder stack is counted once


@needs_model
def test_not_fewer_bytes_on_fast_devices_than_transformers_own_map(tmp_path):
    """Where transformers' own inference returns a valid map, ours keeps at least as many bytes on
    the fastest devices (cumulatively: GPU 0, then GPUs 0-1, then + cpu)."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.integrations.accelerate import infer_auto_device_map

    path, _ = sc.save_tiny(tmp_path / "ckpt")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path)
    total = sc.model_bytes(model)
    groups = tg.tied_groups(model)
    compared = 0
    for max_memory in sc.budget_grid(total, sc.FRACTIONS, 0) + sc.budget_grid(total, sc.FRACTIONS, 2):
        kwargs = dict(no_split_module_classes=model._no_split_modules)
        try:
            theirs = infer_auto_device_map.__wrapped__(model, max_memory=dict(max_memory), **kwargs)
        except Exception:
            continue
        if sc.map_problems(model, theirs, max_memory, groups):
            continue
        ours = infer_auto_device_map(model, max_memory=dict(max_memory), **kwargs)
        order = tg.speed_order(list(max_memory) + ["disk"])
        mine, upstream = tg.bytes_per_device(model, ours, groups), tg.bytes_per_device(model, theirs, groups)
        for i in range(1, len(order)):
            fast = order[:i]
            assert sum(mine.get(d, 0) for d in fast) >= sum(upstream.get(d, 0) for d in fast), (max_memory, ours, theirs)
        compared += 1
    assert compared >= 2, "transformers' own map was valid at too few budgets to compare"


@needs_model
def test_explicit_map_repair_names_the_pair(tmp_path):
    from transformers.integrations.accelerate import _get_device_map

    model = sc.meta_model(sc.tiny_config())
    with pytest.warns(tg.TiedGroupsSplitWarning, match=r"model\.encoder\.language_model\..* is tied to 'model\.decoder"):
        repaired = _get_device_map(model, dict(sc.SPLIT_MAP), None, None)
    assert tg.split_groups(model, repaired) == []
    assert tg.unplaced_parameters(model, repaired) == []
    assert repaired[tg.entry_of(repaired, "model.encoder.vision_tower.patch_embedder.input_proj.weight")] == "cpu"


def test_tied_groups_from_identity_on_a_plain_module():
    import torch.nn as nn

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    assert tg.tied_groups(model) == [("0.weight", "1.weight")]
    placement = tg.Placement(model, {"0": "cpu", "1": "disk"}, tg.tied_groups(model))
    assert tg.split_groups(model, placement.repair()) == []
    assert placement.moves == [("1.weight", "0.weight", "disk", "cpu")]


def test_module_import_is_cheap():
    import subprocess
    import sys

    code = ("import sys, metapatch._tied_groups, metapatch.patches.tied_device_map_transformers, "
            "metapatch.patches.tied_device_map_accelerate; "
            "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "METAPATCH_DISABLE": "all"})
    assert out.stdout.strip() == "[]"


@pytest.mark.gpu(count=2)
def test_two_gpus_load_and_generate(tmp_path):
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    if not HAS_MODEL:
        pytest.skip(NO_MODEL)
    path, reference = sc.save_tiny(tmp_path / "ckpt")
    share = sc.model_bytes(reference) // 3
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, device_map="auto", max_memory={0: share, 1: share, "cpu": share}, offload_folder=str(tmp_path / "off"))
    assert {0, 1} <= set(model.hf_device_map.values()), model.hf_device_map
    sc.check_dispatched(model)
    with torch.no_grad():
        ids, canvas = torch.tensor(sc.PROMPT), torch.tensor(sc.CANVAS)
        got = model(input_ids=ids.to("cuda:0"), decoder_input_ids=canvas.to("cuda:0")).logits.cpu()
        want = reference(input_ids=ids, decoder_input_ids=canvas).logits
        model.generate(input_ids=ids.to("cuda:0"), max_new_tokens=4, max_denoising_steps=3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # GPU kernels round differently from CPU


# ---------------------------------------------------------------------------------------------
# Property: random shapes, tie patterns (identity and declared-only) and budgets


def _random_model(sizes, ties, declared_only):
    import torch
    import torch.nn as nn

    with torch.device("meta"):
        blocks = nn.ModuleList(nn.Sequential(*[nn.Linear(w, w, bias=False) for w in widths]) for widths in sizes)
        model = nn.Module()
        model.blocks = blocks
    declared = {}
    for (src_block, src_layer), (dst_block, dst_layer) in ties:
        src, dst = blocks[src_block][src_layer], blocks[dst_block][dst_layer]
        if (src_block, src_layer) == (dst_block, dst_layer) or src.weight.shape != dst.weight.shape:
            continue
        if declared_only:  # as on a meta model built before transformers ties it
            declared[f"blocks.{dst_block}.{dst_layer}.weight"] = f"blocks.{src_block}.{src_layer}.weight"
        else:
            dst.weight = src.weight
    model.all_tied_weights_keys = declared
    return model


def test_random_models_ties_and_budgets():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from accelerate import infer_auto_device_map

    widths = st.sampled_from([2, 4, 8])
    shapes = st.lists(st.lists(widths, min_size=1, max_size=3), min_size=2, max_size=5)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(sizes=shapes, data=st.data(), declared_only=st.booleans(),
           fraction=st.floats(0.0, 1.6), gpus=st.integers(0, 2))
    def check(sizes, data, declared_only, fraction, gpus):
        layer = st.tuples(st.integers(0, len(sizes) - 1), st.integers(0, 2)).map(
            lambda bl: (bl[0], bl[1] % len(sizes[bl[0]])))
        ties = data.draw(st.lists(st.tuples(layer, layer), max_size=4))
        model = _random_model(sizes, ties, declared_only)
        total = sc.model_bytes(model)
        (budget,) = sc.budget_grid(total, [fraction], gpus)
        problems = sc.sweep_budgets(model, infer_auto_device_map, [budget])
        assert problems == [], (sizes, ties, declared_only, budget)

    hypothesis  # the import above is only the skip guard
    check()
