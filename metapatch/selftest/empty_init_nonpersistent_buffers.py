"""Reproducers for ``empty-init-nonpersistent-buffers``: accelerate ``init_empty_weights(include_buffers=True)``
keeps rotary ``inv_freq`` (a non-persistent buffer, never in a checkpoint) on meta:
``load_checkpoint_and_dispatch`` fails (``we need a `value```); after ``to_empty()`` it is garbage.

``to_empty`` runs under ``_models.nan_sentinel`` (``torch.empty_like`` memory filled with NaN), so that
uninitialised memory cannot by chance hold the right bytes. Fixed means the logits equal
(torch.equal) the model built normally in memory. Both compute on the execution device (``_device``):
``to_empty`` goes there, the maps' memory entries are there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._device import execution_device, main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, max_abs_diff, nan_sentinel, tiny_llama_config

EMPTY_INIT = "empty-init-nonpersistent-buffers"


# -- accelerate init_empty_weights(include_buffers=True) ------------------------------------------

def _empty_llama() -> Any:
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights(include_buffers=True):
        model = LlamaForCausalLM(tiny_llama_config())
    if not model.model.rotary_emb.inv_freq.is_meta:
        raise AssertionError("init_empty_weights(include_buffers=True) left inv_freq off meta: nothing to test")
    return model


def _reference_llama(workdir: Path) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    model.save_pretrained(workdir / "ckpt")
    with torch.no_grad():
        return to_device(model)(device_input_ids()).logits


def _dispatched_logits(model: Any, workdir: Path, device_map: Any) -> Any:
    import torch
    from accelerate import load_checkpoint_and_dispatch

    model = load_checkpoint_and_dispatch(model, str(workdir / "ckpt"), device_map=device_map,
                                         offload_folder=str(workdir / "offload")).eval()
    with torch.no_grad():
        return model(device_input_ids()).logits


_SPLIT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
          "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def _split() -> Dict[str, Any]:
    """_SPLIT with its memory entries on the execution device."""
    return {name: main_device() if device == "cpu" else device for name, device in _SPLIT.items()}


def _equal_logits(got: Any, want: Any) -> Dict[str, Any]:
    import torch

    if not torch.equal(got.cpu(), want.cpu()):
        raise AssertionError(f"logits differ: max abs diff {max_abs_diff(got, want)}")
    return {"max_abs_diff": 0.0}


def include_buffers_dispatch(workdir: Path) -> Dict[str, Any]:
    want = _reference_llama(workdir)
    return _equal_logits(_dispatched_logits(_empty_llama(), workdir, _split()), want)


def to_empty_dispatch(workdir: Path) -> Dict[str, Any]:
    import torch

    want = _reference_llama(workdir)
    model = _empty_llama()
    with nan_sentinel():
        model.to_empty(device=execution_device())
    got = _dispatched_logits(model, workdir, {"": main_device()})
    rotary = model.model.rotary_emb
    expected = type(rotary)(config=tiny_llama_config()).inv_freq
    if not torch.equal(rotary.inv_freq.cpu(), expected):
        raise AssertionError(f"rotary inv_freq {rotary.inv_freq[:4].tolist()}... != constructor's {expected[:4].tolist()}...")
    return _equal_logits(got, want)


def to_empty_load_state_dict(workdir: Path) -> Dict[str, Any]:
    """The torch-native flow (FSDP2 meta init, torchtitan, transformers#45902): build empty, to_empty(),
    then torch's own load_state_dict; accelerate's loader never runs."""
    want = _reference_llama(workdir)
    return _equal_logits(_torch_loaded_logits(_empty_llama(), workdir), want)


def meta_device_to_empty(workdir: Path) -> Dict[str, Any]:
    """Built under torch's own meta device context (transformers#45902: Qwen3.5-MoE's rotary table), then
    to_empty() and load_state_dict: no accelerate anywhere."""
    import torch
    from transformers import LlamaForCausalLM

    want = _reference_llama(workdir)
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config())
    return _equal_logits(_torch_loaded_logits(model, workdir), want)


def _torch_loaded_logits(model: Any, workdir: Path) -> Any:
    """``to_empty()`` (uninitialised memory filled with NaN), then torch's own ``load_state_dict`` of the
    saved checkpoint: accelerate's loader never runs."""
    import torch
    from safetensors.torch import load_file

    with nan_sentinel():
        model.to_empty(device=execution_device())
    model.load_state_dict(load_file(str(workdir / "ckpt" / "model.safetensors")), strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(device_input_ids()).logits


SCENARIOS = [
    Scenario(EMPTY_INIT, "include-buffers-dispatch", f"{__name__}:include_buffers_dispatch",
             "LlamaForCausalLM built with init_empty_weights(include_buffers=True), load_checkpoint_and_dispatch over "
             "cpu and disk: logits equal the in-memory model (unpatched: inv_freq is on the meta device)",
             expected_error="ValueError", expected_message="is on the meta device, we need a `value`"),
    Scenario(EMPTY_INIT, "to-empty-dispatch", f"{__name__}:to_empty_dispatch",
             "the same model after to_empty(device='cpu'), load_checkpoint_and_dispatch: logits equal the in-memory "
             "model (unpatched: inv_freq is to_empty memory)",
             expected_error="AssertionError"),
    Scenario(EMPTY_INIT, "to-empty-load-state-dict", f"{__name__}:to_empty_load_state_dict",
             "the same model after to_empty(device='cpu') loaded with torch's load_state_dict (no accelerate loader): "
             "logits equal the in-memory model (unpatched: inv_freq is to_empty memory, the logits differ)",
             expected_error="AssertionError", expected_message="logits differ"),
    Scenario(EMPTY_INIT, "meta-device-to-empty", f"{__name__}:meta_device_to_empty",
             "LlamaForCausalLM built under torch.device('meta'), to_empty(device='cpu'), torch's load_state_dict: "
             "logits equal the in-memory model (unpatched: inv_freq is to_empty memory, transformers#45902)",
             expected_error="AssertionError", expected_message="logits differ"),
]
