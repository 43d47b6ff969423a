"""transformers-quantized-disk-weights: a bitsandbytes 4-bit layer that ``from_pretrained`` maps to
``"disk"`` is served as the load made it (quantized, with its quant state), never as the checkpoint's
unquantized tensor or as packed data that lost its state.

transformers 5 quantizes (or, for a pre-quantized checkpoint, deserializes) every weight of a
``Linear4bit`` as it loads it, disk-mapped ones included, and then hands a disk-mapped result to
``offload_and_maybe_resave_param``. That keeps the checkpoint's entry in the disk offload index unless a
``WeightConverter`` changed the tensor: a quantization is not a converter, so the index keeps pointing
at the checkpoint's unquantized tensor, and the quantized value with its ``quant_state`` is dropped; for
a pre-quantized checkpoint the packed data is re-saved but its ``quant_state`` is dropped all the same.
The module keeps a placeholder with no state. At the forward, accelerate's hook rebuilds the weight from
that placeholder: an unquantized placeholder quantizes the checkpoint tensor once (the first forward is
right), the hook's move back to meta then marks it quantized, and the second forward puts the unquantized
tensor into a "quantized" weight ("Cannot copy out of meta tensor", a shape error in the 4-bit kernel, or
bitsandbytes' "FP4 quantization state not initialized" assertion). A pre-quantized checkpoint fails at the
first forward (bitsandbytes quantizes the packed bytes again: "only supports 16/32-bit floats").

Where it happens: a map with disk entries on a 4-bit model whose disk-mapped layers are ``Linear4bit``.
An explicit map with ``llm_int8_enable_fp32_cpu_offload=True`` keeps its cpu/disk modules unquantized
(nothing to fix there), but ``device_map="auto"``/"balanced"/"sequential" is resolved only after the
quantizer converted the model (it saw the string), so on a machine with a GPU every ``Linear`` is a
``Linear4bit`` and the inferred map can send some of them to disk. On a CPU-only machine "auto" with
bitsandbytes keeps everything on the CPU, which is why no CPU run saw it.

The fix, where the load made a quantized value for a disk-mapped weight:
* the packed data goes into the user's ``offload_folder`` (the index entry points there, never at the
  checkpoint, which is only read), and the module keeps a meta placeholder that carries the value's
  ``quant_state`` (kept through accelerate's moves to meta by ``bnb-quant-state-offload``): the hooks then
  serve exactly what the in-memory load made. Without an ``offload_folder`` this refuses by name
  (transformers asks for one the same way for the weights it re-saves);
* the quantization itself runs on the device the in-memory model quantizes on, the map's main device
  (where the offloaded layer also computes), not on the CPU: bitsandbytes' CPU and CUDA quantizers are
  different implementations, so only that gives the in-memory model's packed weights bit for bit. The same
  holds for ``"cpu"`` entries of a map whose main device is a GPU. The final map is read where transformers
  validates it with the quantizer (``validate_environment``), for an explicit map and an inferred one.

Everywhere else (no quantizer, no offloaded entry, a CPU main device, a value without a quant state)
upstream runs untouched. transformers 4.57 loads offloaded weights on another path and is not covered.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Dict

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream
from metapatch._offload.device_names import norm_device
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "transformers-quantized-disk-weights"
OFFLOADED = ("cpu", "disk")

# quantizer -> the final device map it validated (the inferred one for "auto"): what the quantization op
# reads to know where a weight goes. Weak: a quantizer lives as long as its model.
_FINAL_MAPS: "weakref.WeakKeyDictionary[Any, Dict[str, Any]]" = weakref.WeakKeyDictionary()


def _main_device(device_map: Mapping) -> Any:
    """The map's first accelerator (accelerate's main device for it), or None where it has none."""
    import torch

    for device in device_map.values():
        if device in OFFLOADED:
            continue
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return None if device.type in ("cpu", "meta") else device
    return None


def _entry(device_map: Mapping, name: str) -> Any:
    """Where ``device_map`` puts the tensor ``name``: its longest matching module prefix."""
    best, found = -1, None
    for prefix, device in device_map.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
            best, found = len(prefix), device
    return found


def _carries_quant_state(value: Any) -> bool:
    """A quantized bitsandbytes 4-bit weight whose meaning needs its ``quant_state`` beside the data."""
    return bool(getattr(value, "bnb_quantized", False)) and getattr(value, "quant_state", None) is not None


# ---------------------------------------------------------------------------------------------------
# The final map, as the quantizer validates it


def validate_environment(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    device_map = kwargs.get("device_map")
    if isinstance(device_map, Mapping):
        # One spelling per device (0, "cuda:0" and torch.device("cpu") are all accepted by accelerate): the
        # quantization op compares entries with "cpu"/"disk" and takes the first other one as the main device.
        device_map = {key: norm_device(device) for key, device in device_map.items()}
    if isinstance(device_map, Mapping) and any(d in OFFLOADED for d in device_map.values()):
        _FINAL_MAPS[instance] = device_map
    else:
        _FINAL_MAPS.pop(instance, None)
    return result


# ---------------------------------------------------------------------------------------------------
# Quantizing an offloaded weight where the in-memory model quantizes it


def _to(values: Any, device: Any) -> Any:
    if isinstance(values, (list, tuple)):
        return type(values)(_to(v, device) for v in values)
    return values.to(device) if hasattr(values, "to") else values


def bnb4bit_quantize_convert(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    device_map = _FINAL_MAPS.get(getattr(instance, "hf_quantizer", None))
    main = _main_device(device_map) if device_map else None
    if main is None:
        return wrapped(*args, **kwargs)
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    input_dict = bound.arguments.get("input_dict")
    layer = bound.arguments.get("full_layer_name")
    names = [layer] if layer else list(input_dict or ())
    if not input_dict or not any(_entry(device_map, name) in OFFLOADED for name in names):
        return wrapped(*args, **kwargs)
    # The offloaded weight was read onto the CPU; the in-memory model quantizes it on ``main``.
    bound.arguments["input_dict"] = {key: _to(value, main) for key, value in input_dict.items()}
    result = wrapped(*bound.args, **bound.kwargs)
    kept = {}
    for key, value in result.items():
        if _carries_quant_state(value):
            module = getattr(value, "module", None)
            value = value.to("cpu")  # data and quant_state; the module link is not carried by Params4bit.to
            value.module = module
        kept[key] = value
    return kept


# ---------------------------------------------------------------------------------------------------
# Keeping what the load made for a disk-mapped weight


def offload_and_maybe_resave_param(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    param = bound.arguments.get("param")
    if not _carries_quant_state(param):
        return wrapped(*args, **kwargs)
    target_name = bound.arguments["target_name"]
    module = getattr(param, "module", None)
    if module is None:
        raise MetapatchError(
            f"cannot offload the quantized weight {target_name} to disk: its bitsandbytes 4-bit parameter "
            "does not name its module, so its quant_state has nowhere to live (metapatch patch "
            f"'{PATCH_ID}')")
    if bound.arguments.get("disk_offload_folder") is None:
        raise MetapatchError(
            f"{target_name} is mapped to disk and quantized at load: its 4-bit weight must be re-saved "
            "(the checkpoint holds it unquantized, or without its quant state); pass offload_folder= to "
            f"from_pretrained (metapatch patch '{PATCH_ID}')")
    index = bound.arguments["disk_offload_index"]
    # The checkpoint's entry is the unquantized tensor (or the packed bytes without their state): the hooks
    # must never serve it. Without an entry, upstream writes the tensor into the offload folder.
    index.pop(target_name, None)
    bound.arguments["param"] = param.data.detach().to("cpu")
    index = wrapped(*bound.args, **bound.kwargs)
    # A meta placeholder that carries the state (its move to meta keeps a host copy of the state:
    # bnb-quant-state-offload), so that accelerate rebuilds the very weight the load made.
    placeholder = param.to("meta")
    placeholder.module = module
    placeholder._is_hf_initialized = True
    module._parameters[target_name.rpartition(".")[2]] = placeholder
    module._is_hf_initialized = True
    return index


PATCH = Patch(
    id=PATCH_ID,
    title="from_pretrained keeps the quantized value (and its quant_state) of a bitsandbytes 4-bit weight "
          "mapped to disk, quantized where the in-memory model quantizes it",
    # Measured (CPU, the selftest scenarios with device_map="auto" resolved to a map with disk entries, as on a
    # GPU machine): transformers 5.25.0 / accelerate 1.16.0 / bitsandbytes 0.50.2. The targets' code is the
    # same from 5.1.0 on (two variants of the quantization op, survey table); 5.0.0 re-saves in another way
    # and 4.57 loads offloaded weights on another code path: neither is covered (left to the survey's --run).
    affects={"transformers": ">=5.1.0", "bitsandbytes": ">=0.46.0"},
    targets=(
        Target("transformers.quantizers.quantizer_bnb_4bit", "Bnb4BitHfQuantizer.validate_environment",
               fingerprints=("47f70ad9fd2ea7bf",),  # 5.0.0 .. 5.25.0
               wrapper=validate_environment),
        Target("transformers.integrations.bitsandbytes", "Bnb4bitQuantize.convert",
               fingerprints=(
                   "d81e386f442b726f",  # 5.10.1 .. 5.25.0 (one result per input)
                   "d49750814549f0e4",  # 5.0.0 .. 5.9.0 (the first input only)
               ),
               wrapper=bnb4bit_quantize_convert),
        Target("transformers.core_model_loading", "offload_and_maybe_resave_param",
               fingerprints=shared_fingerprints("transformers.core_model_loading:offload_and_maybe_resave_param"),
               wrapper=offload_and_maybe_resave_param),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/issues?q=bitsandbytes+4bit+disk+offload+quant_state",),
        forwarded="no",
        note="transformers: offload_and_maybe_resave_param re-saves a weight the load quantized and the module "
             "keeps its quant state; see the upstream diff. It needs bitsandbytes' meta-safe QuantState "
             "(bnb-quant-state-offload's diff) for the state to survive accelerate's moves to meta.",
    ),
)
