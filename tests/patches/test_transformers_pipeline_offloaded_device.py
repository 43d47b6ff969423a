"""transformers-pipeline-offloaded-device: three-way proof on its scenarios (unpatched: upstream's error where
affected; patched: the in-memory pipeline's answer on the dispatch's execution device; the upstream diff alone:
fixed), plus in-process checks of what the wrapper leaves as it found it.

Measured unpatched (RuntimeError "... device type at start of device string: disk" in Pipeline.__init__):
transformers 5.25.0 + accelerate 1.16.0 (every disk-first scenario), 5.11.0 + accelerate 1.13.0 (the mixed map;
the all-disk maps fail earlier there, see the scenarios' ALL_ON_DISK)."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.transformers_pipeline_offloaded_device import PATCH
from metapatch.selftest import _device

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)
ALL_ON_DISK = {"text-generation-nothing-fits", "text-generation-root-on-disk"}


def _all_disk_maps_load() -> bool:
    """Whether upstream loads a map with every module on disk (transformers 5.13+ with accelerate 1.15+)."""
    from metapatch.selftest import unmet

    return not unmet({"transformers": ">=5.13.0.dev0", "accelerate": ">=1.15.0.dev0"})


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"text-generation-nothing-fits", "text-generation-root-on-disk",
                        "text-classification-mixed-map", "text-classification-cpu-first",
                        "unchanged-where-first-entry-computes"}}

    def check_patched(self, scenario, outcome):
        # the device the dispatch computes on: the CPU for the all-disk maps (no accelerator in them), the
        # execution device for maps with memory entries
        if scenario.name in ALL_ON_DISK:
            assert outcome.metrics["pipeline_device"] == "cpu", outcome.metrics
        elif scenario.name in ("text-classification-mixed-map", "text-classification-cpu-first"):
            assert outcome.metrics["pipeline_device"] == outcome.device, outcome.metrics

    def diff_skip(self, scenario):
        if scenario.name in ALL_ON_DISK and not _all_disk_maps_load():
            return ("upstream cannot load a map with every module on disk on this stack (tied-device-map-"
                    "transformers works around it, with a transformers diff of its own); the pipeline diff is "
                    "proven here by text-classification-mixed-map")
        return super().diff_skip(scenario)


# -- in-process: what the wrapper leaves as it found it ---------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
needs_patch = pytest.mark.skipif(not AFFECTED, reason=f"patch not active here: {WHY}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from metapatch.selftest.transformers_pipeline_offloaded_device import _classifier_checkpoint

    return _classifier_checkpoint(tmp_path_factory.mktemp("pipeline-device"))


def _disk_first(checkpoint, tmp_path):
    from transformers import AutoModelForSequenceClassification

    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu",
                  "model.norm": "cpu", "score": "cpu"}
    return AutoModelForSequenceClassification.from_pretrained(checkpoint, device_map=device_map,
                                                              offload_folder=str(tmp_path / "offload")).eval()


@needs_patch
def test_the_model_keeps_its_own_map(checkpoint, tmp_path):
    from transformers import AutoTokenizer, pipeline

    model = _disk_first(checkpoint, tmp_path)
    device_map, copy = model.hf_device_map, dict(model.hf_device_map)
    pipe = pipeline("text-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint))
    assert pipe.device == torch.device("cpu")  # no accelerator in the map: accelerate computes on the CPU
    assert model.hf_device_map is device_map and device_map == copy


@needs_patch
def test_the_map_is_restored_when_upstream_raises(checkpoint, tmp_path):
    from transformers import AutoTokenizer, TextClassificationPipeline

    class Refusing(TextClassificationPipeline):
        def _sanitize_parameters(self, **kwargs):  # called at the end of Pipeline.__init__
            raise LookupError("refused after the device was chosen")

    model = _disk_first(checkpoint, tmp_path)
    device_map = model.hf_device_map
    with pytest.raises(LookupError, match="refused after the device was chosen"):
        Refusing(model=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint))
    assert model.hf_device_map is device_map and next(iter(device_map.values())) == "disk"


def test_an_explicit_device_is_still_refused_for_a_dispatched_model(checkpoint, tmp_path):
    from transformers import AutoTokenizer, pipeline

    model = _disk_first(checkpoint, tmp_path)
    with pytest.raises(ValueError, match="cannot be moved to a specific device"):
        pipeline("text-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint),
                 device=_device.execution_device())


def test_in_memory_model_keeps_upstream_device(checkpoint):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    model = AutoModelForSequenceClassification.from_pretrained(checkpoint).eval()
    pipe = pipeline("text-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint),
                    device="cpu")
    assert pipe.device == torch.device("cpu") and not hasattr(model, "hf_device_map")
