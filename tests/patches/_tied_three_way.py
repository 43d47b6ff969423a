"""What the tied-map family's three-way tests share (one test file per patch id: tied-device-map-transformers,
-accelerate, -disk-index, -meta-pointer, -transformers-v4 and diffusion-gemma-offloaded-embeddings). Which releases
are affected was measured on transformers 4.57.6 and 5.0-5.24 with accelerate 1.10-1.15, and is declared on each
Scenario (``requires``, ``unpatched``):
* all-disk maps (a cpu budget of 10%, tied or untied Llama): never dispatched on 5.0-5.12 (meta
  tensors), refused by accelerate < 1.15 on 5.13+ ("offload the whole model to the disk"), fail while
  loading on 4.57 (SafetensorError);
* the moderate-budget DiffusionGemma load: the whole model goes to disk on 5.11-5.12;
* the small-budget IndexError, the explicit maps splitting a tied group, and the budget sweeps: every
  release that has the model class;
* disk-offloaded tied pairs without an offload-index entry: 4.57 and 5.0-5.12;
* the meta pointer shared by tied groups: accelerate 1.10-1.14.
Scenarios whose model class is missing (DiffusionGemma before 5.11) must report n/a, never fail.
"""

from __future__ import annotations

import os

import pytest

import metapatch
from metapatch.diffs import diffs_for
from metapatch.patches.diffusion_gemma_offloaded_embeddings import PATCH as EMBED_PATCH
from metapatch.patches.tied_device_map_accelerate import PATCH as ACC_PATCH
from metapatch.patches.tied_device_map_disk_index import PATCH as INDEX_PATCH
from metapatch.patches.tied_device_map_meta_pointer import PATCH as POINTER_PATCH
from metapatch.patches.tied_device_map_transformers import PATCH as TF_PATCH
from metapatch.patches.tied_device_map_transformers_v4 import PATCH as V4_PATCH
from metapatch.selftest import _tied as sc
from metapatch.selftest import scenarios_for

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

HAS_MODEL = sc.has_diffusion_gemma()
NO_MODEL = "transformers has no DiffusionGemma (it arrived in 5.11): the DiffusionGemma scenarios do not apply"
needs_model = pytest.mark.skipif(not HAS_MODEL, reason=NO_MODEL)

ALL_PATCHES = (TF_PATCH, ACC_PATCH, INDEX_PATCH, POINTER_PATCH, EMBED_PATCH, V4_PATCH)
GATE = {p.id: bool(metapatch.registry.gate(p).affected) for p in ALL_PATCHES}
SCENARIOS = {s.key: s for p in ALL_PATCHES for s in scenarios_for(p.id)}
DIFF_OF = (TF_PATCH.id, ACC_PATCH.id)  # the others are fixed upstream (fixed_in) or ride on TF's copy


def version_of_installed(dist: str):
    import importlib.metadata

    from packaging.version import Version

    return Version(importlib.metadata.version(dist))


class TiedThreeWay(ThreeWayCase):
    """Each file names its one patch id (``patch_ids``)."""

    workers = int(os.environ.get("METAPATCH_TEST_WORKERS", "2"))

    def not_applicable_reason(self, scenario):
        """What a scenario whose requires are met says n/a about by itself ('' = it runs)."""
        if (scenario.key == "tied-device-map-transformers/tied-llama-budget-sweep"
                and version_of_installed("transformers").major < 5):
            return "needs transformers >= 5.0"
        llama_or_plain = scenario.name.startswith(("untied-llama", "tied-llama", "two-tied"))
        return sc.NEEDS_DIFFUSION_GEMMA if not llama_or_plain and not HAS_MODEL else ""

    def diff_series(self, patch_id):
        # The transformers side is two diffs (device maps; DiffusionGemma's embedding read): both go
        # into the same copy, as they would into one transformers checkout.
        extra = list(diffs_for(EMBED_PATCH.id)) if patch_id == TF_PATCH.id and GATE[EMBED_PATCH.id] else []
        return list(diffs_for(patch_id)) + extra

    def diff_skip(self, scenario):
        """Whether the scenario's upstream diff can fix it on its own in this environment."""
        if scenario.patch_id == EMBED_PATCH.id:
            return ("its diff goes into tied-device-map-transformers' copy of transformers (one checkout): "
                    "test_tied_device_map_transformers.py runs the two together")
        if scenario.patch_id not in DIFF_OF:
            return "no upstream diff: fixed upstream (see the patch's fixed_in)"
        if not GATE[scenario.patch_id]:
            return "the installed version is not affected"
        if scenario.patch_id == TF_PATCH.id and scenario.name != "budget-sweep":
            if GATE[INDEX_PATCH.id] or GATE[POINTER_PATCH.id]:
                return ("loading also needs fixes upstream already has (disk index in transformers 5.24, "
                        "meta pointer in accelerate 1.15): the diff targets the latest releases")
        return ""

    def check_patched(self, scenario, outcome):
        for patch_id, affected in GATE.items():
            # A scenario that never imports a patch's target module (the plain-torch meta-pointer one does
            # not import transformers) leaves that patch pending-import; its own patch must be applied.
            allowed = ({"applied"} if patch_id == scenario.patch_id else {"applied", "pending-import"}) \
                if affected else {"not-affected"}
            assert outcome.states[patch_id] in allowed, (patch_id, outcome.states)
