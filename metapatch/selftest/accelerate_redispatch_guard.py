"""Reproducers for accelerate-redispatch-guard: placing an already offloaded model again.

A tiny Llama is loaded with a real ``from_pretrained(device_map=..., offload_folder=...)`` that puts decoder layers
2 and 3 on disk (meta placeholders behind accelerate's offload hooks; the other entries on the execution
device). Then ``accelerate.cpu_offload(model)``, ``accelerate.disk_offload(model, new_folder)`` and
``accelerate.dispatch_model(model, another_map, offload_dir=new_folder)`` (accelerate#2129). Upstream each
fails with torch's raw ``NotImplementedError: Cannot copy out of meta tensor; no data!``. Fixed means: each call
raises an error that says the weights are offloaded and points at ``device_map``, nothing is written into the
new folders, and the model still computes exactly the in-memory reference afterwards. The in-memory reference
and the map's memory entries are on the execution device (``_device``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from ._device import main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, max_abs_diff, save_tiny_llama

PATCH_ID = "accelerate-redispatch-guard"

_LAYERS_ON_DISK = (2, 3)


def _device_map(disk_layers: Tuple[int, ...]) -> Dict[str, Any]:
    device_map: Dict[str, Any] = {"model.embed_tokens": main_device(), "model.rotary_emb": main_device(),
                                  "model.norm": main_device(), "lm_head": main_device()}
    device_map.update({f"model.layers.{i}": "disk" if i in disk_layers else main_device() for i in range(4)})
    return device_map


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(device_input_ids()).logits


def _refused(label: str, call: Callable[[], Any]) -> str:
    """Run one placement call. torch's raw meta-copy error propagates (the outcome names it); any other error
    must explain the offloading and point at device_map; a call that works is judged by the logits after it."""
    try:
        call()
    except Exception as exc:
        text = str(exc)
        if isinstance(exc, NotImplementedError) and "Cannot copy out of meta tensor" in text and "offload" not in text:
            raise
        if "offload" not in text or "device_map" not in text:
            raise AssertionError(f"{label} raised an error that does not explain the offloading: "
                                 f"{type(exc).__name__}: {text[:300]}") from exc
        return type(exc).__name__
    return "placed"


def placements_of_an_offloaded_model(workdir: Path) -> Dict[str, Any]:
    import accelerate
    from transformers import LlamaForCausalLM

    checkpoint = save_tiny_llama(workdir / "ckpt")
    reference = _logits(to_device(LlamaForCausalLM.from_pretrained(checkpoint).eval()))
    folders = [workdir / name for name in ("cpu-offload", "disk-offload", "dispatch-offload")]

    def offloaded() -> Any:
        model = LlamaForCausalLM.from_pretrained(checkpoint, device_map=_device_map(_LAYERS_ON_DISK),
                                                 offload_folder=str(workdir / "offload")).eval()
        if not any(p.is_meta for p in model.parameters()):
            raise AssertionError("layers 2 and 3 were meant to be offloaded to disk; nothing is on meta")
        return model

    model = offloaded()
    calls: List[Tuple[str, Callable[[], Any]]] = [
        ("cpu_offload", lambda: accelerate.cpu_offload(model, execution_device=main_device())),
        ("disk_offload", lambda: accelerate.disk_offload(model, str(folders[1]), execution_device=main_device())),
        ("dispatch_model", lambda: accelerate.dispatch_model(model, _device_map((1, 2, 3)), main_device=main_device(),
                                                             offload_dir=str(folders[2]))),
    ]
    results = {}
    for label, call in calls:
        results[label] = _refused(label, call)
        diff = max_abs_diff(_logits(model), reference)
        if diff != 0:
            raise AssertionError(f"after {label} ({results[label]}) the model's logits differ from the in-memory "
                                 f"reference by {diff}")
        if results[label] == "placed":
            model = offloaded()  # a release that can place it: the next call starts from a loaded model again
    written = [str(p) for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file()]
    if written and "placed" not in results.values():
        raise AssertionError(f"refused calls wrote files: {written[:5]}")
    return {"max_abs_diff": 0.0, **{f"{label}_outcome": outcome for label, outcome in results.items()}}


SCENARIOS = [
    Scenario(PATCH_ID, "placements-of-an-offloaded-model", f"{__name__}:placements_of_an_offloaded_model",
             "cpu_offload, disk_offload and dispatch_model over a model loaded with layers on disk: each refused with "
             "an error naming the offloading, nothing written, logits still equal the in-memory model (unpatched: "
             "NotImplementedError: Cannot copy out of meta tensor)",
             expected_error="NotImplementedError", expected_message="Cannot copy out of meta tensor", quick=True),
]
