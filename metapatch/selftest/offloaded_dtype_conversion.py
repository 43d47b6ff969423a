"""Reproducers for offloaded-dtype-conversion: converting a model loaded with offloaded parts.

A tiny random Llama is loaded with a real ``from_pretrained(device_map=..., offload_folder=...)`` that puts
layers 1 and 3 on disk, then converted with ``model.to(torch.bfloat16)`` (and ``model.to(<execution
device>, torch.float16)``). Upstream, accelerate's guard on ``model.to`` refuses: ``RuntimeError: You
can't move a model that has some modules offloaded to cpu or disk.`` although nothing would move. Fixed
means: logits and greedy ``generate()`` equal the in-memory model converted the same way (torch.equal),
the offloaded layers are still offloaded, and a real device move is still refused. The map's memory
entries and the reference are on the execution device (``_device``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from . import NotApplicable
from ._device import execution_device, main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, max_abs_diff, save_tiny_llama

PATCH_ID = "offloaded-dtype-conversion"
REFUSAL = "You can't move a model that has some modules offloaded"  # accelerate's guard on model.to
_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
        "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu"}


def _saved(folder: Path) -> Dict[str, Any]:
    from safetensors.torch import load_file

    tensors: Dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _convert_and_compare(workdir: Path, convert: Any, save: bool = False) -> Dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import transformers.integrations.accelerate as dispatching

    if not hasattr(dispatching, "accelerate_dispatch"):
        # 4.x dispatches inside from_pretrained itself: the patch has no place to attach (the bug is there too)
        raise NotApplicable("needs transformers >= 5.0 (from_pretrained dispatching through accelerate_dispatch)")
    checkpoint = save_tiny_llama(workdir / "ckpt")
    reference = convert(to_device(AutoModelForCausalLM.from_pretrained(checkpoint).eval()))
    device_map = {name: main_device() if device == "cpu" else device for name, device in _MAP.items()}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                                 offload_folder=str(workdir / "offload")).eval()
    converted = convert(model)
    if converted is not model:
        raise AssertionError("to() returned another object than the model")
    if not model.model.layers[1].self_attn.q_proj.weight.is_meta:
        raise AssertionError("the conversion loaded the offloaded layers into memory")
    ids = device_input_ids()
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
        if got.dtype != expected.dtype or not torch.equal(got.cpu(), expected.cpu()):
            raise AssertionError(f"logits {got.dtype} vs {expected.dtype}, max abs diff {max_abs_diff(got, expected)}")
        tokens, expected_tokens = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
        if not torch.equal(tokens.cpu(), expected_tokens.cpu()):
            raise AssertionError(f"generate() gave {tokens.tolist()}, in memory {expected_tokens.tolist()}")
    if save:  # what save_pretrained writes: the in-memory model's dtypes and values, also for the disk layers
        for name, tensor in model.state_dict().items():
            if tensor.dtype != reference.state_dict()[name].dtype:
                raise AssertionError(f"state_dict() says {name} is {tensor.dtype}, in memory "
                                     f"{reference.state_dict()[name].dtype}")
        model.save_pretrained(workdir / "saved")
        reference.save_pretrained(workdir / "saved-in-memory")
        saved, expected_saved = _saved(workdir / "saved"), _saved(workdir / "saved-in-memory")
        if saved.keys() != expected_saved.keys():
            raise AssertionError(f"saved keys differ: {sorted(saved.keys() ^ expected_saved.keys())}")
        wrong = [f"{k} ({saved[k].dtype}, in memory {expected_saved[k].dtype})" for k in sorted(saved)
                 if saved[k].dtype != expected_saved[k].dtype or not torch.equal(saved[k], expected_saved[k])]
        if wrong:
            raise AssertionError(f"save_pretrained wrote {len(wrong)} tensors unlike the in-memory model: {wrong[:3]}")
    try:
        model.to("meta")
    except Exception as exc:  # a device move: still refused (accelerate's or metapatch's error)
        if "offloaded" not in str(exc):
            raise AssertionError(f"a device move was refused with an unrelated error: {exc!r}")
    else:
        raise AssertionError("a real device move of the offloaded model was not refused")
    return {"max_abs_diff": 0.0, "dtype": str(got.dtype)}


def to_dtype(workdir: Path) -> Dict[str, Any]:
    """model.to(torch.bfloat16) with layers 1 and 3 on disk."""
    import torch

    return _convert_and_compare(workdir, lambda m: m.to(torch.bfloat16))


def to_own_device_and_dtype(workdir: Path) -> Dict[str, Any]:
    """model.to(<execution device>, torch.float16) ("cpu", or "cuda:0" on a GPU machine): nothing moves."""
    import torch

    return _convert_and_compare(workdir, lambda m: m.to(execution_device(), torch.float16))


def to_bf16_then_fp32(workdir: Path) -> Dict[str, Any]:
    """model.to(torch.bfloat16).to(torch.float32): the lossy bf16 step stays in the offloaded layers' values."""
    import torch

    return _convert_and_compare(workdir, lambda m: m.to(torch.bfloat16).to(torch.float32))


def half_then_float(workdir: Path) -> Dict[str, Any]:
    """model.half().float() (accelerate's guard does not see half/float): the fp16 rounding stays."""
    return _convert_and_compare(workdir, lambda m: m.half().float())


def half_then_save(workdir: Path) -> Dict[str, Any]:
    """model.half() then save_pretrained: the disk layers are written in fp16, as the in-memory model's."""
    return _convert_and_compare(workdir, lambda m: m.half(), save=True)


CHAIN = "logits .* max abs diff"  # unpatched: the offloaded layers skipped the lossy step

SCENARIOS = [
    Scenario(PATCH_ID, "to-dtype-layers-on-disk", f"{__name__}:to_dtype",
             "model.to(torch.bfloat16) on a Llama with layers on disk: equal to the in-memory model converted first "
             "(unpatched: RuntimeError \"You can't move a model that has some modules offloaded\")",
             expected_error="RuntimeError", expected_message=REFUSAL),
    Scenario(PATCH_ID, "to-own-device-and-dtype-layers-on-disk", f"{__name__}:to_own_device_and_dtype",
             "model.to('cpu', torch.float16) with cpu the execution device and layers on disk: a conversion, "
             "equal to the in-memory model converted first",
             expected_error="RuntimeError", expected_message=REFUSAL),
    Scenario(PATCH_ID, "to-bf16-then-fp32-layers-on-disk", f"{__name__}:to_bf16_then_fp32",
             "model.to(torch.bfloat16).to(torch.float32) with layers on disk: equal to the in-memory model converted "
             "the same way (the bf16 rounding kept; unpatched: accelerate's refusal)",
             expected_error="RuntimeError", expected_message=REFUSAL),
    Scenario(PATCH_ID, "half-then-float-layers-on-disk", f"{__name__}:half_then_float",
             "model.half().float() with layers on disk: equal to the in-memory model converted the same way "
             "(unpatched: the disk layers are served at full precision, skipping the fp16 rounding)",
             expected_error="AssertionError", expected_message=CHAIN),
    Scenario(PATCH_ID, "half-then-save-layers-on-disk", f"{__name__}:half_then_save",
             "model.half() then save_pretrained with layers on disk: the same tensors (fp16) as the in-memory model "
             "saves (unpatched: the disk layers are written in fp32)",
             expected_error="AssertionError", expected_message="save_pretrained wrote"),
]
