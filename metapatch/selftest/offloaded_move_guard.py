"""Reproducers for offloaded-move-guard: moving a model whose weights accelerate offloaded.

A tiny Llama is loaded with a real ``from_pretrained(device_map=..., offload_folder=...)`` that puts
two decoder layers on disk (their parameters become meta placeholders behind accelerate offload
hooks). Moving it to a device through any path other than accelerate's own top-level guard gives
torch's raw ``NotImplementedError: Cannot copy out of meta tensor; no data!`` upstream. Fixed means:
every path raises an error that says the weights are offloaded and what to do (``device_map``), and
the model still computes exactly the in-memory reference afterwards. The map's memory entries and the
reference are on the execution device (``_device``); the refused moves go to ``cpu`` on every machine (on
a GPU machine, away from it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from ._device import execution_device, main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, max_abs_diff, save_tiny_llama

PATCH_ID = "offloaded-move-guard"

# Layers 2 and 3 on disk; on a machine without accelerators "cpu" entries are not offloaded, so disk
# is what puts weights behind offload hooks everywhere (a GPU machine behaves the same for disk).
DEVICE_MAP = {
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
    "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu",
}


def _load(workdir: Path, **kwargs: Any) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(workdir / "ckpt", **kwargs).eval()


def _offloaded(workdir: Path) -> Any:
    device_map = {name: main_device() if device == "cpu" else device for name, device in DEVICE_MAP.items()}
    model = _load(workdir, device_map=device_map, offload_folder=str(workdir / "offload"))
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    assert meta, "the device map was meant to offload layers 2 and 3 to disk; nothing is on meta"
    return model


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(device_input_ids()).logits


def is_raw_meta_copy_error(exc: BaseException) -> bool:
    """torch's own error, whatever wording it ends with, and not an explanation of offloading."""
    text = str(exc)
    return isinstance(exc, NotImplementedError) and "Cannot copy out of meta tensor" in text and "offload" not in text


def _expect_clear_refusal(label: str, move: Callable[[], Any]) -> str:
    """Run one move of an offloaded model. The upstream error propagates unchanged (so the outcome
    names it); any other error must explain the offloading and point at device_map."""
    try:
        move()
    except Exception as exc:
        if is_raw_meta_copy_error(exc):
            raise
        text = str(exc)
        if "offload" not in text or "device_map" not in text:
            raise AssertionError(f"{label} raised an error that does not explain the offloading: "
                                 f"{type(exc).__name__}: {text[:300]}") from exc
        return f"{type(exc).__name__}"
    return "moved"  # a release that can move offloaded models; the logits check below judges it


def _check_moves(model: Any, reference: Any, moves: List[Tuple[str, Callable[[], Any]]]) -> Dict[str, Any]:
    results = {label: _expect_clear_refusal(label, move) for label, move in moves}
    diff = max_abs_diff(_logits(model), reference)
    if diff != 0:
        raise AssertionError(f"after {', '.join(results)} the offloaded model's logits differ from the "
                             f"in-memory reference by {diff}")
    return {"max_abs_diff": diff, "moves": results}


def move_offloaded_submodule(workdir: Path) -> Dict[str, Any]:
    """model.model.to / Module.to(model) / model.cpu() / layer.cpu() / attention-block.to on an offloaded
    Llama. (The top-level model.to/.cuda is accelerate's own guard: a RuntimeError before and after.)"""
    import torch

    save_tiny_llama(workdir / "ckpt")
    reference = _logits(to_device(_load(workdir)))
    model = _offloaded(workdir)
    return _check_moves(model, reference, [
        ("model.model.to('cpu')", lambda: model.model.to("cpu")),
        ("torch.nn.Module.to(model, 'cpu')", lambda: torch.nn.Module.to(model, "cpu")),
        ("model.cpu()", lambda: model.cpu()),  # accelerate guards only the top-level .to/.cuda
        ("model.model.layers[2].cpu()", lambda: model.model.layers[2].cpu()),
        ("model.model.layers[3].self_attn.to(torch.device('cpu'), torch.float32)",
         lambda: model.model.layers[3].self_attn.to(torch.device("cpu"), torch.float32)),
    ])


def move_offloaded_peft_model(workdir: Path) -> Dict[str, Any]:
    """PeftModel.to on a LoRA model whose base has layers offloaded to disk."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    save_tiny_llama(workdir / "ckpt")
    # LoRA on the layers that stay in memory: adapters on offloaded layers are a different issue.
    config = LoraConfig(r=4, target_modules=r".*layers\.[01]\.self_attn\.(q_proj|v_proj)", init_lora_weights=False)
    reference_model = get_peft_model(to_device(_load(workdir)), config)
    adapter = get_peft_model_state_dict(reference_model)
    reference = _logits(reference_model)
    peft_model = get_peft_model(_offloaded(workdir), config)
    set_peft_model_state_dict(peft_model, adapter)
    return _check_moves(peft_model, reference, [("peft_model.to('cpu')", lambda: peft_model.to("cpu"))])


def moves_that_keep_working(workdir: Path) -> Dict[str, Any]:
    """What works today keeps working: .half() of an offloaded model equals an in-memory .half(), and
    a dispatched model with nothing offloaded moves (submodule and Module.to) as before."""
    import torch

    save_tiny_llama(workdir / "ckpt")
    half_reference = _logits(to_device(_load(workdir)).half())
    offloaded = _offloaded(workdir).half()
    half_diff = max_abs_diff(_logits(offloaded), half_reference)
    if half_diff != 0:
        raise AssertionError(f".half() on an offloaded model: logits differ from in-memory .half() by {half_diff}")
    reference = _logits(to_device(_load(workdir)))
    device = execution_device()
    dispatched = _load(workdir, device_map={"": main_device()})
    dispatched.model.to(device)
    torch.nn.Module.to(dispatched, device, torch.float32)
    if device == "cpu":
        dispatched.lm_head.cpu()
    else:
        dispatched.lm_head.cuda(device)
    moved_diff = max_abs_diff(_logits(dispatched), reference)
    if moved_diff != 0:
        raise AssertionError(f"moving a dispatched, not offloaded model changed its logits by {moved_diff}")
    return {"max_abs_diff": max(half_diff, moved_diff), "half_max_abs_diff": half_diff}


SCENARIOS = [
    Scenario(PATCH_ID, "move-offloaded-submodule", f"{__name__}:move_offloaded_submodule",
             "model.model.to('cpu'), torch.nn.Module.to(model, 'cpu'), model.cpu(), layer.cpu() on a disk-offloaded Llama "
             "give a clear error; the model still matches the in-memory logits",
             expected_error="NotImplementedError", expected_message="Cannot copy out of meta tensor"),
    Scenario(PATCH_ID, "move-offloaded-peft-model", f"{__name__}:move_offloaded_peft_model",
             "PeftModel.to('cpu') around a disk-offloaded Llama gives a clear error",
             expected_error="NotImplementedError", expected_message="Cannot copy out of meta tensor"),
    Scenario(PATCH_ID, "moves-that-keep-working", f"{__name__}:moves_that_keep_working",
             ".half() of an offloaded model equals an in-memory .half(); a dispatched model with nothing "
             "offloaded moves as before (passes with and without metapatch)",
             # a no-regression guard, not a reproducer: the test suite runs it, `metapatch selftest` only
             # with --include-slow or --scenario, to keep the users' run short
             in_selftest=False),
]
