"""Reproducers for accelerate-root-disk-map: the map infer_auto_device_map returns when nothing fits.

A tiny random Llama (in memory) gets ``infer_auto_device_map(model, max_memory={"cpu": 0})``, which is
``{"": "disk"}``, and a real ``accelerate.dispatch_model(model, device_map, offload_dir=...)``. Upstream
that fails with ``FileNotFoundError: .../index.json`` (nothing was written to the folder). Fixed means the
dispatched model's logits, and a greedy continuation computed from them, equal the in-memory model's
(torch.equal), with every weight left on meta between forwards. The in-memory model and the dispatch's
``main_device`` are the execution device (``_device``): on a GPU machine every weight comes from disk to
GPU 0 at each forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from . import NotApplicable
from ._harness import Scenario
from ._models import device_input_ids, tiny_llama_config

PATCH_ID = "accelerate-root-disk-map"


def _greedy(model: Any, ids: Any, steps: int = 3) -> Any:
    import torch

    for _ in range(steps):
        logits = model(ids).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1).to(ids.device)], dim=-1)
    return ids


def inferred_all_on_disk(workdir: Path) -> Dict[str, Any]:
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import LlamaForCausalLM

    from ._device import main_device, to_device

    torch.manual_seed(0)
    model = to_device(LlamaForCausalLM(tiny_llama_config()).eval())
    ids = device_input_ids()
    with torch.no_grad():
        expected, expected_tokens = model(ids).logits, _greedy(model, ids)
    device_map = infer_auto_device_map(model, max_memory={"cpu": 0})
    if dict(device_map) != {"": "disk"}:
        raise AssertionError(f"expected the whole model on disk, infer_auto_device_map gave {dict(device_map)}")
    try:
        dispatch_model(model, device_map=device_map, main_device=main_device(), offload_dir=str(workdir / "offload"))
    except ValueError as exc:
        if "offload the whole model to the disk" in str(exc):
            # accelerate <= 1.14: a clear refusal that says what to do, not this bug
            raise NotApplicable(f"this accelerate refuses the map with a clear error: {exc}") from exc
        raise
    with torch.no_grad():
        got, tokens = model(ids).logits, _greedy(model, ids)
    if not torch.equal(got, expected):
        raise AssertionError(f"logits differ: max abs diff {float((got - expected).abs().max())}")
    if not torch.equal(tokens, expected_tokens):
        raise AssertionError(f"greedy continuation {tokens.tolist()} != in memory {expected_tokens.tolist()}")
    if not all(p.is_meta for p in model.parameters()):
        raise AssertionError("weights stayed in memory: the model was not offloaded")
    return {"max_abs_diff": 0.0}


SCENARIOS = [
    Scenario(PATCH_ID, "inferred-map-all-on-disk", f"{__name__}:inferred_all_on_disk",
             "infer_auto_device_map(max_memory={'cpu': 0}) gives {'': 'disk'}; dispatch_model with it: logits equal "
             "the in-memory model (unpatched: FileNotFoundError .../index.json)",
             expected_error="FileNotFoundError", expected_message=r"index\.json"),
]
