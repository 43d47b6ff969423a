"""Reproducers for accelerate-tie-before-load: accelerate's big-model recipe on a model with tied embeddings.

A tiny Llama with ``tie_word_embeddings=True`` is built in memory and saved with ``save_pretrained``
(which stores the tied group once: no ``lm_head.weight``). The recipe from accelerate's docs then builds
the same architecture under ``init_empty_weights`` (not tied there) and loads the checkpoint with
``load_checkpoint_and_dispatch`` (or ``load_checkpoint_in_model`` + ``dispatch_model``), without the
``model.tie_weights()`` call the docs add. Upstream: ``ValueError: weight is on the meta device, we need
a `value` to put in on cpu.`` with an explicit cpu+disk map, ``Cannot copy out of meta tensor`` with
``device_map="auto"`` (huggingface/accelerate#1289). Fixed means: the loaded model's logits equal the
in-memory model's exactly. A guard scenario checks that untied models load exactly as before. The
in-memory model and the map's memory entries are on the execution device (``_device``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._device import main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, tiny_llama_config

PATCH_ID = "accelerate-tie-before-load"

# Layers 2 and 3 on disk, the tied pair (embedding and head) together in memory: an explicit map a user
# writes for this model. On a machine without accelerators "cpu" entries are not offloaded; disk is what
# puts weights behind offload hooks. The memory entries are the execution device's (cpu_disk_map).
CPU_DISK_MAP = {
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
    "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu",
}
NO_SPLIT = ["LlamaDecoderLayer"]


def cpu_disk_map() -> Dict[str, Any]:
    """CPU_DISK_MAP with its memory entries on the execution device (GPU 0 where there is one)."""
    return {name: main_device() if device == "cpu" else device for name, device in CPU_DISK_MAP.items()}


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(device_input_ids()).logits


def _save_in_memory_model(workdir: Path, tie: bool) -> Any:
    """Build the model in memory, save it, and return its logits: the reference."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tie)).eval()
    if tie and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("the in-memory model was meant to be tied")
    model.save_pretrained(workdir / "ckpt")
    return _logits(to_device(model))


def _empty_model(tie: bool) -> Any:
    """The documented recipe: the architecture built under init_empty_weights (no tie_weights() call)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=tie))


def _compare(model: Any, reference: Any, label: str) -> Dict[str, Any]:
    import torch

    from ._models import max_abs_diff

    got = _logits(model.eval())
    if not torch.equal(got, reference):
        raise AssertionError(f"{label}: logits differ from the in-memory model (max abs diff "
                             f"{max_abs_diff(got, reference)})")
    return {"max_abs_diff": 0.0, "head_tied": model.lm_head.weight is model.model.embed_tokens.weight}


def dispatch_auto(workdir: Path) -> Dict[str, Any]:
    """Tied Llama: init_empty_weights + load_checkpoint_and_dispatch(device_map="auto")."""
    from accelerate import load_checkpoint_and_dispatch

    reference = _save_in_memory_model(workdir, tie=True)
    model = load_checkpoint_and_dispatch(_empty_model(tie=True), str(workdir / "ckpt"), device_map="auto",
                                         no_split_module_classes=NO_SPLIT)
    return _compare(model, reference, 'load_checkpoint_and_dispatch(device_map="auto")')


def dispatch_cpu_disk_map(workdir: Path) -> Dict[str, Any]:
    """Tied Llama: init_empty_weights + load_checkpoint_and_dispatch with an explicit cpu+disk map."""
    from accelerate import load_checkpoint_and_dispatch

    reference = _save_in_memory_model(workdir, tie=True)
    model = load_checkpoint_and_dispatch(_empty_model(tie=True), str(workdir / "ckpt"), device_map=cpu_disk_map(),
                                         offload_folder=str(workdir / "offload"), no_split_module_classes=NO_SPLIT)
    if not model.model.layers[2].self_attn.q_proj.weight.is_meta:
        raise AssertionError("the device map was meant to offload layers 2 and 3 to disk; they are in memory")
    return _compare(model, reference, "load_checkpoint_and_dispatch with a cpu+disk map")


def load_in_model_then_dispatch(workdir: Path) -> Dict[str, Any]:
    """Tied Llama: init_empty_weights + load_checkpoint_in_model (the lower-level entry point) with a
    cpu+disk map, then dispatch_model."""
    from accelerate import dispatch_model
    from accelerate.utils import load_checkpoint_in_model

    reference = _save_in_memory_model(workdir, tie=True)
    model = _empty_model(tie=True)
    offload_folder = str(workdir / "offload")
    load_checkpoint_in_model(model, str(workdir / "ckpt"), device_map=cpu_disk_map(), offload_folder=offload_folder,
                             offload_state_dict=True)
    model = dispatch_model(model, device_map=cpu_disk_map(), offload_dir=offload_folder)
    return _compare(model, reference, "load_checkpoint_in_model + dispatch_model")


def untied_models_unchanged(workdir: Path) -> Dict[str, Any]:
    """A model with tie_word_embeddings=False loads exactly (both entry points, auto and explicit maps) and
    its head stays its own tensor: nothing is tied that the model does not declare."""
    from accelerate import load_checkpoint_and_dispatch

    reference = _save_in_memory_model(workdir, tie=False)
    seen = {}
    for label, device_map, extra in (("auto", "auto", {}),
                                     ("cpu_disk", cpu_disk_map(), {"offload_folder": str(workdir / "offload")})):
        model = load_checkpoint_and_dispatch(_empty_model(tie=False), str(workdir / "ckpt"), device_map=device_map,
                                             no_split_module_classes=NO_SPLIT, **extra)
        seen[label] = _compare(model, reference, f"untied model, device_map={label}")
        if seen[label]["head_tied"]:
            raise AssertionError(f"untied model, device_map={label}: lm_head.weight became embed_tokens.weight")
    return {"max_abs_diff": 0.0, "head_tied": False, "maps": sorted(seen)}


NO_VALUE = "weight is on the meta device, we need a `value` to put in on cpu"
_UPSTREAM_ERRORS = "unpatched: ValueError 'weight is on the meta device, we need a `value`'"

SCENARIOS = [
    Scenario(PATCH_ID, "dispatch-cpu-disk-map", f"{__name__}:dispatch_cpu_disk_map",
             "a tied Llama built under init_empty_weights, load_checkpoint_and_dispatch with layers on disk: logits "
             f"equal the in-memory model's ({_UPSTREAM_ERRORS})",
             expected_error="ValueError", expected_message=NO_VALUE),
    Scenario(PATCH_ID, "dispatch-auto", f"{__name__}:dispatch_auto",
             'the same with device_map="auto": tied parameters placed together, logits equal the in-memory model\'s '
             "(unpatched on a machine without accelerators: NotImplementedError 'Cannot copy out of meta tensor')",
             expected_error="NotImplementedError", expected_message="Cannot copy out of meta tensor"),
    Scenario(PATCH_ID, "load-checkpoint-in-model", f"{__name__}:load_in_model_then_dispatch",
             "the same through load_checkpoint_in_model + dispatch_model: logits equal the in-memory model's "
             f"({_UPSTREAM_ERRORS})",
             expected_error="ValueError", expected_message=NO_VALUE),
    Scenario(PATCH_ID, "untied-models-unchanged", f"{__name__}:untied_models_unchanged",
             "a Llama with tie_word_embeddings=False loads exactly and stays untied (passes with and without metapatch)",
             in_selftest=False),  # a no-regression guard: the test suite runs it, selftest with --include-slow
]
