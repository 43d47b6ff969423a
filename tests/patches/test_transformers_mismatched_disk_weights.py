"""transformers-mismatched-disk-weights: three-way proof on its scenarios (unpatched: ValueError at the first
forward, a load memory refuses, or a float16 T5 wo; patched: the in-memory answer; the upstream diff alone, with
accelerate's diff for tensors an offload index lacks: fixed), plus in-process checks of the index rule.

Measured unpatched (ValueError "Trying to set a tensor of shape ..." at the first forward; T5 logits 0.0039 off
on 5.25.0, 0.0022 on 5.11.0): transformers 5.7.0, 5.11.0 and 5.25.0."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.transformers_mismatched_disk_weights import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)
# The initialised value is served by the mechanism of this patch (a tensor the model holds that the disk
# index lacks): its accelerate diff goes on the path with the transformers diff.
SERVED_BY = "accelerate-unindexed-disk-tensors"


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"llama-score-on-disk", "bert-classifier-on-disk", "mismatch-refused-at-load",
                        "t5-keep-in-fp32-on-disk"}}

    def diff_companions(self, patch_id):
        return (SERVED_BY,)

    def check_patched(self, scenario, outcome):
        if scenario.name == "llama-score-on-disk":
            assert outcome.metrics["head_shape"] == [2, 64] and outcome.metrics["head_tensors"] == ["score.weight"]
        elif scenario.name == "bert-classifier-on-disk":
            assert outcome.metrics["head_tensors"] == ["classifier.bias", "classifier.weight"]
        elif scenario.name == "t5-keep-in-fp32-on-disk":
            assert outcome.metrics["wo_dtype"] == "torch.float32"


# -- in-process ---------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
needs_patch = pytest.mark.skipif(not AFFECTED, reason=f"patch not active here: {WHY}")

DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
              "score": "disk"}


def _save(path, num_labels, safe_serialization=True):
    from transformers import LlamaForSequenceClassification

    from metapatch.selftest._models import tiny_llama_config

    torch.manual_seed(0)
    LlamaForSequenceClassification(tiny_llama_config(num_labels=num_labels, pad_token_id=0)).save_pretrained(
        path, safe_serialization=safe_serialization)
    return path


def _load(path, num_labels, **kwargs):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(7)
    loaded = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, **kwargs)
    return loaded if isinstance(loaded, tuple) else loaded.eval()  # (model, info) with output_loading_info


def _logits(model):
    from metapatch.selftest._models import input_ids

    with torch.no_grad():
        return model(input_ids=input_ids()).logits


@needs_patch
def test_a_checkpoint_without_safetensors(tmp_path):
    """A .bin checkpoint: transformers re-saves every disk-mapped tensor into the offload folder (its own index
    entries); the mismatched one is still initialised and served from memory, as the in-memory load."""
    path = _save(tmp_path / "ckpt", 5, safe_serialization=False)
    offloaded = _load(path, 2, ignore_mismatched_sizes=True, device_map=DEVICE_MAP,
                      offload_folder=str(tmp_path / "offload"))
    assert torch.equal(_logits(offloaded), _logits(_load(path, 2, ignore_mismatched_sizes=True)))


@needs_patch
def test_matching_shapes_keep_the_checkpoint_entry(tmp_path):
    """Same number of labels: nothing is mismatched, the head is the checkpoint's, read from its file."""
    path = _save(tmp_path / "ckpt", 5)
    offloaded, info = _load(path, 5, device_map=DEVICE_MAP, offload_folder=str(tmp_path / "offload"),
                            output_loading_info=True)
    assert not info["mismatched_keys"]
    assert torch.equal(_logits(offloaded.eval()), _logits(_load(path, 5)))
    assert not (tmp_path / "offload").exists() or not any((tmp_path / "offload").iterdir())


@needs_patch
def test_loading_info_reports_the_mismatch_as_in_memory(tmp_path):
    path = _save(tmp_path / "ckpt", 5)
    _, in_memory = _load(path, 2, ignore_mismatched_sizes=True, output_loading_info=True)
    _, offloaded = _load(path, 2, ignore_mismatched_sizes=True, device_map=DEVICE_MAP,
                         offload_folder=str(tmp_path / "offload"), output_loading_info=True)
    assert sorted(map(tuple, offloaded["mismatched_keys"])) == sorted(map(tuple, in_memory["mismatched_keys"]))
    assert [key for key, *_ in offloaded["mismatched_keys"]] == ["score.weight"]


@needs_patch
def test_placeholder_dtypes_are_the_in_memory_ones_and_ties_survive(tmp_path):
    """The float32 placeholder replaces the float16 one wherever the model holds it (every tie), and only where
    the load made another dtype: the float16 tensors on disk keep theirs."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "ckpt")
    model = T5ForConditionalGeneration.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float16, offload_folder=str(tmp_path / "offload"),
        device_map={"shared": "disk", "encoder": "disk", "decoder": "cpu", "lm_head": "cpu"})
    in_memory = T5ForConditionalGeneration.from_pretrained(tmp_path / "ckpt", dtype=torch.float16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {name: p.dtype for name, p in in_memory.named_parameters()}
    assert model.encoder.embed_tokens.weight is model.shared.weight  # the tie survives
