"""Reproducer for bnb-params4bit-extra-attributes: accelerate's offload (dispatch_model) of a 4-bit model
as transformers 5.x loaded it, with bitsandbytes < 0.50."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from metapatch._offload.hook_state import hooked_as_accelerate_asks

from ._bnb import base_checkpoint, dispatch, load_quantized, offloaded_linears, quant_config
from ._harness import Scenario

PATCH_ID = "bnb-params4bit-extra-attributes"

def dispatch_as_loaded(workdir: Path) -> Dict[str, Any]:
    """dispatch_model of a 4-bit model exactly as from_pretrained returned it (no copy: the
    parameters keep the attributes transformers set on them) with layers on disk. accelerate
    rebuilds each offloaded weight as Params4bit(meta, **old.__dict__); with transformers 5.x and
    bitsandbytes < 0.50 that is a TypeError (``_is_hf_initialized``). Single quant, dispatch only:
    the forward through offloaded 4-bit layers is bnb-quant-state-offload's scenario."""
    import bitsandbytes as bnb

    model = dispatch(load_quantized(base_checkpoint(workdir), quant_config("nf4", False)), workdir)
    offloaded = offloaded_linears(model)
    if not offloaded:
        raise AssertionError("the device map was meant to offload 4-bit layers to disk; none found")
    wrong = [name for name, m in offloaded
             if not (isinstance(m.weight, bnb.nn.Params4bit) and m.weight.is_meta
                     and m.weight.quant_state is not None and hooked_as_accelerate_asks(m))]
    if wrong:
        raise AssertionError(f"offloaded 4-bit layers not left as hooked meta Params4bit with a quant state: {wrong[:5]}")
    return {"max_abs_diff": 0.0, "offloaded_4bit_layers": len(offloaded)}


SCENARIOS = [
    Scenario(PATCH_ID, "dispatch-as-loaded", f"{__name__}:dispatch_as_loaded",
             "dispatch_model with disk layers of a 4-bit model as from_pretrained returned it: "
             "Params4bit.__new__ rejects the _is_hf_initialized attribute transformers 5.x sets "
             "(bitsandbytes < 0.50)",
             expected_error="TypeError", expected_message="_is_hf_initialized"),
]
