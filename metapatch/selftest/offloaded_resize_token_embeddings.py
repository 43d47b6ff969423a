"""Reproducers for ``offloaded-resize-token-embeddings``: ``model.resize_token_embeddings(n)`` on a model whose
input embedding and head accelerate offloaded to disk (huggingface/transformers#25554).

A tiny Llama (untied, or with ``tie_word_embeddings=True``) is saved as a random safetensors checkpoint and
loaded with a real ``from_pretrained(device_map=..., offload_folder=...)`` that puts ``model.embed_tokens``,
``lm_head`` and layers 2-3 on disk. The same resizes run, under the same seeds, on the in-memory model.
Fixed means, compared with ``torch.equal`` (no tolerance: the same float operations on the same device; the
map's memory entries and the in-memory model are on the execution device, ``_device``, where the resize runs,
its random rows drawn from that device's generator):

* the resized embedding (read through its own forward, so through the offload hook) and the head equal
  the in-memory model's: the first ``old_vocab`` rows are the checkpoint's rows, the new rows are what
  transformers' initialisation gives in memory (mean resizing's multivariate normal sample by default,
  ``_init_weights`` with ``mean_resizing=False``), shrinking drops the last rows;
* logits over prompts holding new token ids, and a greedy ``generate``, equal the in-memory model's;
* a tied head is still the embedding's parameter object right after the resize (a forward through
  accelerate's hooks replaces an offloaded tied pair's parameters by separate objects, with or without a resize);
* nothing is written: checkpoint and offload folder files keep their hashes, nothing new appears in the
  work or working directory.

Upstream: with mean resizing (the default) ``RuntimeError: Tensor.item() cannot be called on meta tensors``;
with ``mean_resizing=False`` the resize returns, and the first forward fails with ``ValueError: Trying to set
a tensor of shape torch.Size([128, 64]) in "weight" (which has shape torch.Size([140, 64]))``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from ._harness import Scenario

PATCH_ID = "offloaded-resize-token-embeddings"
_MODULE = "metapatch.selftest.offloaded_resize_token_embeddings"
OLD_VOCAB = 128

DEVICE_MAP = {
    "model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
    "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "disk",
}


def _prompt(vocab: int) -> Any:
    """Token ids over the whole resized vocabulary, new ids included, on the execution device."""
    import torch

    from ._device import to_device
    from ._models import input_ids

    ids = input_ids(vocab_size=min(OLD_VOCAB, vocab))
    new_ids = torch.arange(OLD_VOCAB, vocab)[:4] if vocab > OLD_VOCAB else torch.tensor([vocab - 1])
    return to_device(torch.cat([ids, new_ids[None, :]], dim=1))


def _observed(model: Any) -> Dict[str, Any]:
    """What a user sees of the resized model: embedding rows through the embedding's forward (its hook
    loads the offloaded weight), the head's rows as logits of unit hidden states, logits and tokens (read
    back on the CPU)."""
    import torch

    from ._device import execution_device

    device = execution_device()
    vocab = model.config.vocab_size
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    ids = _prompt(vocab)
    with torch.no_grad():
        hidden = embedding.weight.shape[1]
        return {
            "embedding": embedding(torch.arange(vocab, device=device)[None, :])[0].cpu(),
            "head": head(torch.eye(hidden, device=device)[None, :, :])[0].T.cpu(),
            "logits": model(input_ids=ids).logits.cpu(),
            "tokens": model.generate(input_ids=ids, max_new_tokens=4, do_sample=False).cpu(),
            "shapes": (tuple(embedding.weight.shape), tuple(head.weight.shape)),
        }


def _hashes_of(*folders: Path) -> Dict[str, str]:
    from ._peft import _hashes

    return {f"{folder.name}/{name}": digest for folder in folders if folder.exists()
            for name, digest in _hashes(folder).items()}


def _resize_all(model: Any, calls: List[Dict[str, Any]]) -> None:
    import torch

    for seed, call in enumerate(calls):
        torch.manual_seed(100 + seed)
        model.resize_token_embeddings(**call)


def run_resizes(workdir: Path, tied: bool, calls: List[Dict[str, Any]]) -> Dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from ._device import main_device, to_device
    from ._models import max_abs_diff, save_tiny_llama
    from ._peft import _SideEffects

    checkpoint = save_tiny_llama(workdir / "ckpt", tie_word_embeddings=tied)
    original_rows = load_file(str(checkpoint / "model.safetensors"))["model.embed_tokens.weight"]

    reference_model = to_device(LlamaForCausalLM.from_pretrained(checkpoint).eval())
    _resize_all(reference_model, calls)
    reference = _observed(reference_model)
    reference_tied = reference_model.lm_head.weight is reference_model.model.embed_tokens.weight
    del reference_model

    device_map = {name: main_device() if device == "cpu" else device for name, device in DEVICE_MAP.items()}
    model = LlamaForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                             offload_folder=str(workdir / "offload")).eval()
    if not model.model.embed_tokens.weight.is_meta:
        raise AssertionError("the device map was meant to offload the embedding to disk; it is not on meta")
    watch = _SideEffects(workdir, checkpoint, ())  # nothing may be written, the offload folder included
    files = _hashes_of(checkpoint, workdir / "offload")
    try:
        _resize_all(model, calls)
        # Right after the resize: accelerate's hooks replace an offloaded tied pair's parameters by separate
        # objects at every forward (measured without any resize too), so identity is checked before one.
        tied_now = model.lm_head.weight is model.model.embed_tokens.weight
        got = _observed(model)
    finally:
        problems = watch.problems()
        if _hashes_of(checkpoint, workdir / "offload") != files:
            problems.append("checkpoint or offload folder files changed")
        if problems:
            raise AssertionError("resize_token_embeddings wrote files: " + "; ".join(problems))

    if got["shapes"] != reference["shapes"]:
        raise AssertionError(f"resized shapes {got['shapes']} differ from the in-memory model's {reference['shapes']}")
    kept = min(OLD_VOCAB, model.config.vocab_size)
    if not torch.equal(got["embedding"][:kept], original_rows[:kept]):
        raise AssertionError(f"the first {kept} embedding rows are not the checkpoint's (max abs diff "
                             f"{max_abs_diff(got['embedding'][:kept], original_rows[:kept])})")
    for key in ("embedding", "head", "logits"):
        if not torch.equal(got[key], reference[key]):
            raise AssertionError(f"{key} differ from the in-memory resized model (max abs diff "
                                 f"{max_abs_diff(got[key], reference[key])})")
    if not torch.equal(got["tokens"], reference["tokens"]):
        raise AssertionError(f"greedy tokens differ: {got['tokens'].tolist()} vs {reference['tokens'].tolist()}")
    if tied_now != reference_tied:
        raise AssertionError(f"the head is {'' if tied_now else 'not '}the embedding's parameter after the resize; "
                             f"in memory it is {'' if reference_tied else 'not'}")
    return {"max_abs_diff": max_abs_diff(got["logits"], reference["logits"]), "vocab_size": model.config.vocab_size,
            "tied": tied_now}


def resize_untied(workdir: Path) -> Dict[str, Any]:
    """Grow with mean resizing, grow again to a multiple of 8 without it, then shrink."""
    return run_resizes(workdir, tied=False, calls=[
        {"new_num_tokens": 140},
        {"new_num_tokens": 150, "pad_to_multiple_of": 8, "mean_resizing": False},
        {"new_num_tokens": 120},
    ])


def resize_tied(workdir: Path) -> Dict[str, Any]:
    return run_resizes(workdir, tied=True, calls=[{"new_num_tokens": 140}, {"new_num_tokens": 136}])


def resize_without_mean_resizing(workdir: Path) -> Dict[str, Any]:
    """The report's path: ``mean_resizing=False`` (or a transformers release before mean resizing) lets the
    resize return, and the first forward meets the old weight in the hook's weights map."""
    return run_resizes(workdir, tied=False, calls=[{"new_num_tokens": 140, "mean_resizing": False}])


# The upstream errors (regular expressions): mean resizing reads the old weight on meta; without it, the
# first forward puts the old (128, 64) weight from the hook's weights map into the resized embedding.
_ITEM_ON_META = r"Tensor\.item\(\) cannot be called on meta tensors"
_OLD_SHAPE = r"Trying to set a tensor of shape torch\.Size\(\[128, 64\]\)"

SCENARIOS = [
    Scenario(PATCH_ID, "resize-offloaded-untied", f"{_MODULE}:resize_untied",
             "resize_token_embeddings(140) (mean resizing), (150, pad_to_multiple_of=8, mean_resizing=False), (120) on "
             "a Llama with embed_tokens and lm_head on disk: weights, logits and greedy tokens equal the in-memory "
             "model's; nothing written", expected_error="RuntimeError", expected_message=_ITEM_ON_META),
    Scenario(PATCH_ID, "resize-offloaded-tied", f"{_MODULE}:resize_tied",
             "the same with tie_word_embeddings=True: the head stays the embedding's parameter",
             expected_error="RuntimeError", expected_message=_ITEM_ON_META),
    Scenario(PATCH_ID, "resize-offloaded-no-mean-resizing", f"{_MODULE}:resize_without_mean_resizing",
             "resize_token_embeddings(140, mean_resizing=False): upstream's resize returns and the first forward "
             "fails in set_module_tensor_to_device (the reported error)", expected_error="ValueError",
             expected_message=_OLD_SHAPE),
]
