"""Reproducer for accelerate-unindexed-disk-tensors: a disk-mapped tensor that the checkpoint never holds
(MarianMT's sinusoidal position table, ``_keys_to_ignore_on_save``) has no entry in the offload index
transformers builds, and accelerate's hook fails at the first forward; fixed means the logits of two
forwards equal the in-memory model's (torch.equal). The in-memory model and the map's memory entries are on the
execution device (``_device``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._device import main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids

PATCH_ID = "accelerate-unindexed-disk-tensors"
_VOCAB = 64

# MarianMT's sinusoidal position table is never saved (_keys_to_ignore_on_save) and is computed at load;
# with its module on disk, nothing writes it to the offload index.
_MARIAN_MAP = {"model.shared": "cpu", "model.encoder.embed_tokens": "cpu", "model.encoder.embed_positions": "disk",
               "model.encoder.layers": "cpu",
               "model.decoder": "cpu", "lm_head": "cpu", "final_logits_bias": "cpu"}


def never_saved_table_on_disk(workdir: Path) -> Dict[str, Any]:
    """MarianMTModel with its encoder's sinusoidal position embedding on disk: logits of two forwards equal
    the in-memory model's (torch.equal)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(vocab_size=_VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
                          decoder_start_token_id=0)
    torch.manual_seed(0)
    MarianMTModel(config).save_pretrained(workdir / "ckpt")
    reference = to_device(MarianMTModel.from_pretrained(workdir / "ckpt").eval())
    device_map = {name: main_device() if device == "cpu" else device for name, device in _MARIAN_MAP.items()}
    loaded = MarianMTModel.from_pretrained(workdir / "ckpt", device_map=device_map,
                                           offload_folder=str(workdir / "offload")).eval()
    if not loaded.model.encoder.embed_positions.weight.is_meta:
        raise AssertionError("the device map was meant to put the encoder's position table on disk")
    ids = device_input_ids(vocab_size=_VOCAB, length=8)
    with torch.no_grad():
        expected = reference(input_ids=ids, decoder_input_ids=ids).logits
        got = loaded(input_ids=ids, decoder_input_ids=ids).logits
        again = loaded(input_ids=ids, decoder_input_ids=ids).logits
    if not (torch.equal(got, expected) and torch.equal(again, expected)):
        raise AssertionError(f"logits differ: max abs diff {float((got - expected).abs().max())}")
    return {"max_abs_diff": 0.0}



# A task head loaded over a base model's checkpoint: ``score`` is missing from it, transformers initialises it at
# load (the model's _init_weights, on CPU, as in memory), and with its module on disk nothing writes it to the
# offload index either. The mechanism is the missing key, not the architecture.
_HEAD_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
             "score": "disk"}


def new_head_from_base_checkpoint_on_disk(workdir: Path) -> Dict[str, Any]:
    """LlamaForSequenceClassification loaded over a LlamaModel checkpoint with its new ``score`` head on disk
    (same seed before both loads): logits of two forwards equal the in-memory model's (torch.equal)."""
    import torch
    from transformers import LlamaForSequenceClassification, LlamaModel

    from ._models import tiny_llama_config

    torch.manual_seed(0)
    LlamaModel(tiny_llama_config(pad_token_id=0)).save_pretrained(workdir / "ckpt")
    torch.manual_seed(7)
    reference = to_device(LlamaForSequenceClassification.from_pretrained(workdir / "ckpt", num_labels=3).eval())
    device_map = {name: main_device() if device == "cpu" else device for name, device in _HEAD_MAP.items()}
    torch.manual_seed(7)
    loaded = LlamaForSequenceClassification.from_pretrained(workdir / "ckpt", num_labels=3, device_map=device_map,
                                                            offload_folder=str(workdir / "offload")).eval()
    if not loaded.score.weight.is_meta:
        raise AssertionError("the device map was meant to put the new head on disk")
    ids = device_input_ids(vocab_size=128, length=8)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        again = loaded(input_ids=ids).logits
    if not (torch.equal(got.cpu(), expected.cpu()) and torch.equal(again.cpu(), expected.cpu())):
        raise AssertionError(f"logits differ: max abs diff {float((got.cpu() - expected.cpu()).abs().max())}")
    return {"max_abs_diff": 0.0}

SCENARIOS = [
    Scenario(PATCH_ID, "never-saved-table-on-disk", f"{__name__}:never_saved_table_on_disk",
             "MarianMTModel with its encoder's sinusoidal position embedding on disk: the table is never saved "
             "(_keys_to_ignore_on_save) and computed at load, so the disk offload index has no entry for it; "
             "logits of two forwards equal the in-memory model (unpatched: KeyError "
             "'model.encoder.embed_positions.weight'). Found by the sweep",
             expected_error="KeyError", expected_message="embed_positions.weight"),
    Scenario(PATCH_ID, "new-head-from-base-checkpoint-on-disk", f"{__name__}:new_head_from_base_checkpoint_on_disk",
             "LlamaForSequenceClassification over a LlamaModel checkpoint with its new score head on disk: the head "
             "is missing from the checkpoint and initialised at load, so the disk offload index has no entry for it; "
             "logits of two forwards equal the in-memory model's, same seed (unpatched: KeyError 'score.weight')",
             expected_error="KeyError", expected_message="score.weight", requires={"transformers": ">=5.7.0"}),
]
