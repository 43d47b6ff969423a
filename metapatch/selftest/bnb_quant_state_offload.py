"""Reproducers: bitsandbytes 4-bit layers offloaded by accelerate (cpu/disk) with a meta-safe
QuantState (patch ``bnb-quant-state-offload``) and accelerate's emptiness probe
(patch ``accelerate-emptiness-probe``).

A tiny random Llama is quantized in memory on the execution device (``_device``: GPU 0 where there is
one, else ``device_map={"": "cpu"}``), then ``accelerate.dispatch_model`` sends two decoder layers to
``disk`` with that device as the main one; with a GPU the same path runs for layers mapped to ``"cpu"``
(``cpu_offload_gpu_main``). Outputs must be ``torch.equal`` to the undispatched quantized model (the same
packed weights through the same kernels on the same device).
"""


from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

from . import NotApplicable
from ._bnb import (OFFLOADED_LAYERS, assert_equal_outputs, base_checkpoint,
                   counting_quantize_calls, dispatch, load_quantized, logits, offloaded_linears, quant_config)
from ._harness import Scenario

PATCH_ID = "bnb-quant-state-offload"  # accelerate-emptiness-probe's record names these scenarios too
COMBOS_DOUBLE_QUANT = (("nf4", True, "float32"), ("fp4", True, "bfloat16"),
                       ("nf4", True, "bfloat16"), ("fp4", True, "float32"))
COMBOS_SINGLE_QUANT = (("nf4", False, "float32"), ("fp4", False, "bfloat16"),
                       ("nf4", False, "bfloat16"), ("fp4", False, "float32"))


def forward_matches_reference(workdir: Path, quant_type: str, double_quant: bool, compute_dtype: str,
                              offload_to: str = "disk", main_device: Any = None) -> Tuple[Dict[str, Any], Any, Any]:
    """Dispatch with offloaded 4-bit layers; two forwards (the reload repeats at every forward)
    must equal the undispatched model, without re-quantizing and leaving the weights offloaded.
    Returns (metrics, in-memory reference model, dispatched model)."""
    import copy

    from ._models import input_ids

    config = quant_config(quant_type, double_quant, compute_dtype)
    ids = input_ids()
    reference_model = load_quantized(base_checkpoint(workdir), config, main_device)
    # What was loaded, read before any forward (see saved_state_matches for why).
    reference_model.metapatch_loaded_state = {k: v.detach().cpu().clone()
                                              for k, v in reference_model.state_dict().items()}
    # A copy taken before any forward: both hold the very same packed weights and quant states.
    model = dispatch(copy.deepcopy(reference_model), workdir / f"{quant_type}-{double_quant}-{compute_dtype}",
                     offload_to, main_device)
    reference = logits(reference_model, ids)
    with counting_quantize_calls() as counts:
        outputs = [logits(model, ids) for _ in range(2)]
    what = f"{quant_type} double_quant={double_quant} compute={compute_dtype} offload={offload_to}"
    diff = assert_equal_outputs(reference, outputs, what)
    if sum(counts.values()):
        raise AssertionError(f"{what}: the reload re-quantized ({counts})")
    resident = [name for name, m in offloaded_linears(model) if not m.weight.is_meta]
    if resident:
        raise AssertionError(f"{what}: offloaded weights stayed resident after forward: {resident}")
    return {"max_abs_diff": diff, "quantize_calls": sum(counts.values())}, reference_model, model


# ---------------------------------------------------------------------------------------------
# Scenario functions


def dispatch_double_quant(workdir: Path) -> Dict[str, Any]:
    """Dispatch alone: accelerate's emptiness probe serializes Linear4bit modules next to already
    offloaded ones (``offset.item()`` on meta). Every module that holds tensors gets its hook."""
    model = dispatch(load_quantized(base_checkpoint(workdir), quant_config("nf4", True)), workdir)
    missing = [name for name, m in model.named_modules()
               if any(True for _ in m.parameters(recurse=False)) and not hasattr(m, "_hf_hook")
               and not any(hasattr(p, "_hf_hook") for p in _parents(model, name))]
    if missing:
        raise AssertionError(f"modules with weights but no accelerate hook: {missing[:5]}")
    return {"max_abs_diff": 0.0, "hooked_modules": sum(hasattr(m, "_hf_hook") for m in model.modules())}


def _parents(model: Any, name: str) -> List[Any]:
    parts = name.split(".")
    return [model.get_submodule(".".join(parts[:i])) for i in range(len(parts))]


def quantizes_on(device: Any, quant_type: str) -> bool:
    """Whether the installed bitsandbytes can quantize ``quant_type`` on ``device`` at all
    (bitsandbytes 0.46.x quantizes only nf4 on the CPU): a capability of the release, not
    anything offloading changes."""
    import bitsandbytes.functional as F
    import torch

    try:
        F.quantize_4bit(torch.randn(64, 64, device=device), quant_type=quant_type)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _matrix(workdir: Path, combos: Tuple[Tuple[str, bool, str], ...], **placement: Any) -> Dict[str, Any]:
    from ._device import main_device

    metrics: Dict[str, Any] = {"max_abs_diff": 0.0}
    device = placement.get("main_device", main_device())
    unsupported = [c for c in combos if not quantizes_on(device, c[0])]
    if unsupported:
        import bitsandbytes

        metrics["not_supported_by_bitsandbytes"] = [f"{q}/dq={d}/{c}" for q, d, c in unsupported]
        metrics["bitsandbytes"] = bitsandbytes.__version__
        combos = tuple(c for c in combos if c not in unsupported)
    for quant_type, double_quant, compute_dtype in combos:
        result, reference_model, model = forward_matches_reference(workdir, quant_type, double_quant, compute_dtype,
                                                                   **placement)
        metrics["max_abs_diff"] = max(metrics["max_abs_diff"], result["max_abs_diff"])
        metrics[f"{quant_type}/dq={double_quant}/{compute_dtype}"] = result["max_abs_diff"]
        if (quant_type, double_quant, compute_dtype) == combos[0]:
            metrics.update(saved_state_matches(workdir, reference_model, model))
    return metrics


def disk_forward_double_quant(workdir: Path) -> Dict[str, Any]:
    """nf4/fp4 x float32/bfloat16 compute with double quant, and for the first of them the
    state_dict/save_pretrained round trip (see saved_state_matches)."""
    return _matrix(workdir, COMBOS_DOUBLE_QUANT)


def disk_forward_single_quant(workdir: Path) -> Dict[str, Any]:
    return _matrix(workdir, COMBOS_SINGLE_QUANT)


def cpu_offload_gpu_main(workdir: Path) -> Dict[str, Any]:
    """The seed's placement: GPU main device, 4-bit layers mapped to ``"cpu"`` (needs CUDA)."""
    import torch

    if not torch.cuda.is_available():
        raise NotApplicable("needs a CUDA device")
    metrics: Dict[str, Any] = {"max_abs_diff": 0.0}
    for combos in (COMBOS_DOUBLE_QUANT, COMBOS_SINGLE_QUANT):
        result = _matrix(workdir, combos, offload_to="cpu", main_device=0)
        metrics["max_abs_diff"] = max(metrics["max_abs_diff"], result.pop("max_abs_diff"))
        metrics.update(result)
    return metrics


def _quant_state_keys(state_dict: Dict[str, Any]) -> List[str]:
    suffixes = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
    return [k for k in state_dict if k.endswith(suffixes) or ".quant_state.bitsandbytes__" in k]


def _unpacked_blob(tensor: Any) -> Dict[str, Any]:
    from bitsandbytes.utils import unpack_tensor_to_dict

    return unpack_tensor_to_dict(tensor)


def _assert_same_state(reference: Dict[str, Any], found: Dict[str, Any], what: str,
                       allow_meta: Tuple[str, ...] = ()) -> None:
    import torch

    if set(reference) != set(found):
        raise AssertionError(f"{what}: keys differ: {sorted(set(reference) ^ set(found))[:6]}")
    for key, expected in reference.items():
        value = found[key]
        if value.is_meta and key in allow_meta:
            continue
        if value.is_meta or not torch.equal(value.cpu(), expected):
            raise AssertionError(f"{what}: {key} differs from the in-memory quantized model")
        if ".quant_state.bitsandbytes__" in key and _unpacked_blob(value.cpu()) != _unpacked_blob(expected):
            raise AssertionError(f"{what}: packed quant state {key} differs")


def saved_state_matches(workdir: Path, reference_model: Any, model: Any) -> Dict[str, Any]:
    """No data loss, after forwards through the dispatched model: its state_dict() (offloaded
    weights stay meta, their quant states are real), accelerate's offloaded state dict, and
    save_pretrained -> from_pretrained all give the in-memory model's packed weights and quant
    states, the packed nested_offset exactly.

    On a CPU with AVX512-BF16, bitsandbytes (0.49.2 and 0.50.2 measured) repacks an in-memory
    4-bit layer for its CPU kernel at the first inference forward (absmax to bfloat16) and its
    ``state_dict()`` converts back with a lossy re-quantization: upstream behaviour that the
    dispatched model's in-memory layers share with the reference. So the expected state is what the
    reference gives after its forwards, except for the offloaded layers, whose weights must still be
    exactly what was loaded. Elsewhere the two are the same."""
    from accelerate.utils.modeling import get_state_dict_offloaded_model
    from transformers import AutoModelForCausalLM

    from ._models import input_ids

    offloaded_prefixes = tuple(f"model.layers.{i}." for i in OFFLOADED_LAYERS)
    loaded = reference_model.metapatch_loaded_state
    reference = {k: loaded[k] if k.startswith(offloaded_prefixes) else v.detach().cpu().clone()
                 for k, v in reference_model.state_dict().items()}
    quant_keys = set(_quant_state_keys(reference))
    may_be_meta = tuple(k for k in reference if k.startswith(offloaded_prefixes) and k not in quant_keys)
    _assert_same_state(reference, model.state_dict(), "dispatched state_dict()", allow_meta=may_be_meta)
    _assert_same_state(reference, get_state_dict_offloaded_model(model), "get_state_dict_offloaded_model")

    model.save_pretrained(workdir / "saved")
    device = str(reference_model.device)
    reloaded = AutoModelForCausalLM.from_pretrained(workdir / "saved", device_map={"": device}).eval()
    _assert_same_state(reference, reloaded.state_dict(), "save_pretrained -> from_pretrained")
    ids = input_ids()
    # The dispatched model's outputs equal the in-memory model's (forward_matches_reference); the
    # reloaded checkpoint must give the dispatched model's (the two differ only where bitsandbytes'
    # CPU repack round trip changed the in-memory reference's state, see above).
    assert_equal_outputs(logits(model, ids), [logits(reloaded, ids)], "reloaded checkpoint")
    return {"quant_states_compared": sum(1 for k in quant_keys if "bitsandbytes__" in k)}


def unrecoverable_offset_refused(workdir: Path) -> Dict[str, Any]:
    """A double-quant state that reached meta with no record of its scalar (built on meta, as
    ``from_dict(device="meta")`` does) cannot be serialized: the error names the parameter and no
    file is written. Unpatched this is the raw ``Tensor.item()`` RuntimeError."""
    import bitsandbytes as bnb
    import torch
    from bitsandbytes.functional import QuantState
    from safetensors.torch import save_file

    from ._device import execution_device

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compress_statistics=True, quant_type="nf4").to(execution_device())
    stats = {k[len("weight."):]: v for k, v in layer.state_dict().items() if k.startswith("weight.")}
    layer.weight.quant_state = QuantState.from_dict(stats, device=torch.device("meta"))
    target = workdir / "layer.safetensors"
    try:
        save_file(layer.state_dict(prefix="proj."), str(target))
    except Exception as exc:
        message = str(exc)
        if "Tensor.item() cannot be called on meta tensors" in message:
            raise
        if "proj.weight" not in message or "nested_offset" not in message:
            raise AssertionError(f"the refusal does not name the parameter and the value: {message}") from exc
        if target.exists():
            raise AssertionError(f"{target} was written despite the refusal") from exc
        return {"max_abs_diff": 0.0, "error": type(exc).__name__}
    raise AssertionError(f"a state with no recoverable nested_offset was serialized to {target}")


def peft_lora_over_offloaded(workdir: Path) -> Dict[str, Any]:
    """The seed's path: PeftModel.from_pretrained (LoRA, non-zero weights) over a dispatched
    double-quant model with offloaded 4-bit layers matches the same adapter on the in-memory
    quantized model."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from ._models import input_ids

    path = base_checkpoint(workdir)
    torch.manual_seed(3)
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                                        init_lora_weights=False))
    adapter.save_pretrained(workdir / "lora")
    config = quant_config("nf4", True)
    ids = input_ids()
    plain = logits(load_quantized(path, config), ids)
    reference = logits(PeftModel.from_pretrained(load_quantized(path, config), workdir / "lora").eval(), ids)
    if torch.equal(plain, reference):
        raise AssertionError("the LoRA adapter does not change the output: the comparison would prove nothing")
    model = dispatch(load_quantized(path, config), workdir)
    peft_model = PeftModel.from_pretrained(model, workdir / "lora").eval()
    diff = assert_equal_outputs(reference, [logits(peft_model, ids), logits(peft_model, ids)],
                                "PeftModel over the dispatched model")
    return {"max_abs_diff": diff}


_HERE = __name__
SCENARIOS = [
    Scenario(PATCH_ID, "dispatch-double-quant", f"{__name__}:dispatch_double_quant",
             "dispatch_model of a double-quant 4-bit model with layers on disk: accelerate's "
             "state_dict() emptiness probe hits QuantState.as_dict -> offset.item() on meta",
             expected_error="RuntimeError", in_selftest=False),
    Scenario(PATCH_ID, "disk-forward-double-quant", f"{__name__}:disk_forward_double_quant",
             "double-quant 4-bit layers offloaded to disk: two forwards equal the in-memory model "
             "(nf4/fp4 x float32/bfloat16 compute), no re-quantization; state_dict() and "
             "save_pretrained of the dispatched model reload identical packed weights and quant states",
             expected_error="RuntimeError"),
    Scenario(PATCH_ID, "disk-forward-single-quant", f"{__name__}:disk_forward_single_quant",
             "4-bit layers (no double quant) offloaded to disk: the reload finds the quant state on "
             "meta ('Cannot copy out of meta tensor')",
             expected_error="NotImplementedError", in_selftest=False),
    Scenario(PATCH_ID, "unrecoverable-offset-refused", f"{__name__}:unrecoverable_offset_refused",
             "a meta double-quant state with no recorded nested_offset is refused by name, never "
             "written with a placeholder",
             expected_error="RuntimeError"),
    Scenario(PATCH_ID, "peft-lora-over-offloaded", f"{__name__}:peft_lora_over_offloaded",
             "PeftModel.from_pretrained (LoRA) over a dispatched double-quant model with disk layers",
             expected_error="RuntimeError", in_selftest=False),
    Scenario(PATCH_ID, "cpu-offload-gpu-main", f"{__name__}:cpu_offload_gpu_main",
             "GPU main device, 4-bit layers mapped to 'cpu' (needs CUDA)",
             expected_error="RuntimeError", in_selftest=False),
]
