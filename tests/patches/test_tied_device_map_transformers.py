"""tied-device-map-transformers: tied-weight-aware device maps in transformers (DiffusionGemma's regex-tied
encoder/decoder, and the same bugs on a tiny Llama, tied and untied): three-way proof per scenario
(subprocesses; what the tied-map family's files share, and the releases measured, is in _tied_three_way.py),
the transformers diff's all-disk hunk alone, and selftest's n/a where DiffusionGemma is missing. In-process checks of the map functions cover the full-size 26B-A4B config on meta (simulated GPU
budgets, no CUDA needed) and a comparison with transformers' own map where it succeeds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import metapatch
from metapatch._offload.tied_maps import bytes_per_device, speed_order, split_groups, unplaced_parameters
from metapatch._offload.tied_members import tied_groups
from metapatch._offload.tied_placement import Placement, TiedGroupsSplitWarning, entry_of
from metapatch.diffs import _as_package_relative, _run_patch, diffs_for
from metapatch.patches.tied_device_map_transformers import PATCH as TF_PATCH
from metapatch.selftest import _tied as sc
from metapatch.selftest import run_scenario
from metapatch.selftest.tied_device_map_transformers import SPLIT_MAP

from _three_way import explain  # tests/patches/_three_way.py
from _tied_three_way import HAS_MODEL, NO_MODEL, SCENARIOS, TiedThreeWay, needs_model  # tests/patches/_tied_three_way.py

_explain = explain


def _version(dist: str):
    import importlib.metadata

    from packaging.version import Version

    return Version(importlib.metadata.version(dist))


def _between(dist: str, low: str, high: str) -> bool:
    from packaging.version import Version

    return Version(low) <= _version(dist) < Version(high)


def _version_of(text: str):
    from packaging.version import Version

    return Version(text)


class TestThreeWay(TiedThreeWay):
    patch_ids = (TF_PATCH.id,)

    @needs_model
    def test_patched_explicit_map_warns_naming_the_pair(self, runs):
        metrics = runs.get(SCENARIOS["tied-device-map-transformers/explicit-map-split-group"], "patched").metrics
        assert metrics["warned_pairs"], metrics
        assert "model.encoder.language_model" in metrics["warning"] and "model.decoder" in metrics["warning"]

    @needs_model
    def test_patched_loads_dispatch_across_cpu_and_disk(self, runs):
        for key in ("tied-device-map-transformers/auto-map-moderate-budget",
                    "tied-device-map-transformers/auto-map-small-budget"):
            assert "disk" in runs.get(SCENARIOS[key], "patched").metrics["devices"]


@pytest.mark.skipif(HAS_MODEL, reason="the installed transformers has DiffusionGemma")
def test_scenarios_without_their_model_class_are_na_in_selftest(tmp_path):
    """Where DiffusionGemma is missing its scenarios are n/a in ``metapatch selftest`` (never FAILED nor
    an ImportError); a selection of n/a scenarios only is reported as "nothing ran" (exit 1, as documented)."""
    import json
    import subprocess
    import sys

    env = {**os.environ}
    env.pop("METAPATCH_DISABLE", None)
    repo = str(Path(metapatch.__file__).resolve().parents[1])  # this very metapatch, from any cwd
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-m", "metapatch", "selftest", "--json", "--include-slow",
                          "--patch", TF_PATCH.id, "--scenario", "auto-map-small-budget"],
                         capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["nothing_ran"] is True and "Traceback" not in out.stderr
    (row,) = report["rows"]
    assert row["scenario"] == f"{TF_PATCH.id}/auto-map-small-budget"
    assert row["verdict"].startswith("n/a") and "DiffusionGemmaForBlockDiffusion" in row["verdict"], row
    assert row["ok"] is True


def test_all_disk_hunk_alone_fixes_an_untied_model(tmp_path):
    """Three-way proof, third leg, for the all-disk map of an untied model: the transformers diff's
    accelerate_dispatch hunk alone (applied to a copy of the installed transformers) makes the upstream
    error go away. Where transformers >= 5.13 meets accelerate < 1.15 only: before 5.13 transformers
    never dispatched such a map (main has since), and accelerate 1.15 dispatches it itself."""
    from metapatch.diffs import installed_package_dir

    if not (_version("transformers") >= _version_of("5.13.0.dev0") and _between("accelerate", "1.0", "1.15.0.dev0")):
        pytest.skip("needs transformers >= 5.13 with accelerate < 1.15, where only the dispatch step is missing")
    (diff,) = diffs_for(TF_PATCH.id)
    text = _as_package_relative(diff)
    header, *hunks = text.split("\n@@")
    (hunk,) = [h for h in hunks if "def accelerate_dispatch" in h.splitlines()[0]]
    import shutil

    shutil.copytree(installed_package_dir("transformers"), tmp_path / "transformers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    applied = _run_patch(header + "\n@@" + hunk.rstrip("\n") + "\n", tmp_path)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    key = "tied-device-map-transformers/untied-llama-all-offload"
    unpatched = run_scenario(SCENARIOS[key], patched=False, cwd=str(tmp_path))
    assert unpatched.error_type == "ValueError", _explain(unpatched)
    with_hunk = run_scenario(SCENARIOS[key], patched=False, pythonpath=[str(tmp_path)], cwd=str(tmp_path))
    assert with_hunk.passed, _explain(with_hunk)
    assert with_hunk.metrics["max_abs_diff"] <= sc.LOGITS_TOLERANCE


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
    groups = tied_groups(full_size_model)
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
    used = bytes_per_device(full_size_model, device_map)
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
    groups = tied_groups(model)
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
        order = speed_order(list(max_memory) + ["disk"])
        mine, upstream = bytes_per_device(model, ours, groups), bytes_per_device(model, theirs, groups)
        for i in range(1, len(order)):
            fast = order[:i]
            assert sum(mine.get(d, 0) for d in fast) >= sum(upstream.get(d, 0) for d in fast), (max_memory, ours, theirs)
        compared += 1
    assert compared >= 2, "transformers' own map was valid at too few budgets to compare"


@needs_model
def test_explicit_map_repair_names_the_pair(tmp_path):
    from transformers.integrations.accelerate import _get_device_map

    model = sc.meta_model(sc.tiny_config())
    with pytest.warns(TiedGroupsSplitWarning, match=r"model\.encoder\.language_model\..* is tied to 'model\.decoder"):
        repaired = _get_device_map(model, dict(SPLIT_MAP), None, None)
    assert split_groups(model, repaired) == []
    assert unplaced_parameters(model, repaired) == []
    assert repaired[entry_of(repaired, "model.encoder.vision_tower.patch_embedder.input_proj.weight")] == "cpu"


def test_tied_groups_from_identity_on_a_plain_module():
    import torch.nn as nn

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    assert tied_groups(model) == [("0.weight", "1.weight")]
    placement = Placement(model, {"0": "cpu", "1": "disk"}, tied_groups(model))
    assert split_groups(model, placement.repair()) == []
    assert placement.moves == [("1.weight", "0.weight", "disk", "cpu")]


def test_one_device_spelled_two_ways_does_not_split_a_tie():
    """``0`` and ``"cuda:0"`` (or ``torch.device("cuda", 0)``) are one GPU to accelerate: a tie across them is on one
    device, nothing to repair or warn about."""
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False), nn.Linear(8, 8))
    model[1].weight = model[0].weight
    for spelled in ("cuda:0", torch.device("cuda", 0)):
        placement = Placement(model, {"0": 0, "1": spelled, "2": "cpu"}, tied_groups(model))
        assert placement.violations() == []
        placement.repair()
        assert placement.moves == []
    assert Placement(model, {"0": 0, "1": "cuda:1", "2": "cpu"}, tied_groups(model)).violations() == [0]


def test_module_import_is_cheap():
    import subprocess
    import sys

    code = ("import sys, metapatch._offload.tied_maps, metapatch._offload.tied_placement, "
            "metapatch.patches.tied_device_map_transformers, "
            "metapatch.patches.tied_device_map_accelerate; "
            "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "METAPATCH_DISABLE": "all"})
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not HAS_MODEL, reason=NO_MODEL)
@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_budgets_simulated_on_the_cpu(tmp_path, gpus):
    """The maps the GPU runs rely on, inferred on any machine (map inference only reads budgets): one GPU
    with the moderate budget of ``auto-map-moderate-budget`` (half on GPU 0, half on the CPU) holds GPU 0, cpu
    and disk; the two-GPU test's thirds hold both GPUs. Every parameter mapped, tied groups whole, budgets kept."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.integrations.accelerate import infer_auto_device_map

    path, _ = sc.save_tiny(tmp_path / "ckpt")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path)
    total = sc.model_bytes(model)
    if gpus == 1:
        budget = int(total * 0.6)
        max_memory, wanted = {0: budget // 2, "cpu": budget - budget // 2}, {"0", "cpu", "disk"}
    else:
        share = total // 3
        max_memory, wanted = {0: share, 1: share, "cpu": share}, {"0", "1"}
    device_map = infer_auto_device_map(model, max_memory=dict(max_memory), no_split_module_classes=model._no_split_modules)
    assert wanted <= set(map(str, device_map.values())), device_map
    assert sc.map_problems(model, device_map, max_memory, tied_groups(model)) == []


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


def test_a_repair_names_each_moved_member_beside_another_member(tmp_path):
    """BertLMHeadModel's tied head bias (cls.predictions.bias / decoder.bias) moves as a whole group when the map
    splits it from the tied embedding's disk: the warning named the first member as tied to itself."""
    import re
    import warnings

    transformers = pytest.importorskip("transformers")
    from metapatch.sweep import shrink

    config = shrink.tiny_config(transformers.BertConfig)
    config.is_decoder = True
    transformers.BertLMHeadModel(config).save_pretrained(tmp_path / "ckpt")
    device_map = {"bert.embeddings": "disk", "bert.encoder.layer.0": "cpu", "bert.encoder.layer.1": "cpu", "cls": "cpu"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformers.BertLMHeadModel.from_pretrained(tmp_path / "ckpt", device_map=device_map,
                                                     offload_folder=str(tmp_path / "offload"))
    pairs = [pair for w in caught if issubclass(w.category, TiedGroupsSplitWarning)
             for pair in re.findall(r"'([\w.]+)' \(on \w+\) is tied to '([\w.]+)'", str(w.message))]
    assert ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight") in pairs
    assert pairs and all(member != anchor for member, anchor in pairs), pairs
