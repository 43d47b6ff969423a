"""Scenario functions of ``peft-offload-redispatch`` (declared in ``peft_offload_redispatch.py``):
one LoRA training step over an offloaded base.

A tiny Llama with layers 2-3 offloaded to disk (fp32 through ``from_pretrained`` with a device map
and ``offload_folder``; 4-bit nf4 double quant quantized on the CPU and then dispatched to disk) gets
a non-zero LoRA adapter from ``get_peft_model`` (same seed as the in-memory run), one forward with
labels, ``backward`` and one SGD step. Compared with the same step on the in-memory model:

* the trainable parameters are the adapter's only, with the same names;
* gradients and updated adapter values are equal (``torch.equal``: the same kernels run on the same
  values, so no tolerance is needed on the CPU; on a GPU, within :data:`GPU_STEP_TOLERANCE`, see there);
* the base is unchanged: after ``unload()`` the offloaded model's logits equal the untouched base's,
  and the checkpoint and the offload folder keep their file hashes; nothing is written outside the
  offload folder.

Upstream, the adapters of the offloaded layers are on ``meta``: ``backward`` gives them meta
gradients (or the forward fails), so the step is not the in-memory step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

# Both runs compute on the execution device (``_device``: the in-memory base on it, the offloaded one with it
# as the main device). On a GPU the backward of scaled_dot_product_attention (its memory-efficient kernel,
# the one fp32 inputs get) accumulates with atomic adds, so two runs of the same step may differ in the last
# bits of a gradient; the forward, and everything on the CPU, is bit-equal. A wrong or meta adapter differs
# by orders of magnitude more (gradients here are ~1e-3).
GPU_STEP_TOLERANCE = 1e-6
GPU_STEP_REASON = ("the backward of scaled_dot_product_attention on CUDA accumulates with atomic adds: "
                   "gradients of two equal runs may differ in the last bits")


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                      lora_dropout=0.0, init_lora_weights=False)


def train_step(model: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """One step of SGD on a fixed batch: (gradients, parameters after the step) of the trainable
    parameters, by name."""
    import torch
    from peft import get_peft_model

    from ._models import device_input_ids

    torch.manual_seed(7)
    peft_model = get_peft_model(model, _lora())
    peft_model.train()
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(list(trainable.values()), lr=0.5)
    ids = device_input_ids()
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in trainable.items()}
    optimizer.step()
    after = {n: p.detach().clone() for n, p in trainable.items()}
    return {"grads": grads, "after": after, "loss": float(loss)}, {"model": peft_model}


def _step_tolerance() -> float:
    from ._device import on_gpu

    return GPU_STEP_TOLERANCE if on_gpu() else 0.0


def _close(a: Any, b: Any, tolerance: float) -> bool:
    import torch

    from ._models import max_abs_diff

    return torch.equal(a, b) if tolerance == 0 else max_abs_diff(a, b) <= tolerance


def _compare_steps(got: Dict[str, Any], want: Dict[str, Any], tolerance: Optional[float] = None) -> Dict[str, Any]:
    from ._models import max_abs_diff

    if tolerance is None:
        tolerance = _step_tolerance()

    if set(got["grads"]) != set(want["grads"]):
        raise AssertionError(f"trainable parameters differ: {sorted(set(got['grads']) ^ set(want['grads']))[:6]}")
    if any("lora_" not in name for name in got["grads"]):
        raise AssertionError(f"base parameters are trainable: {[n for n in got['grads'] if 'lora_' not in n][:4]}")
    worst = 0.0
    for name, grad in want["grads"].items():
        other = got["grads"][name]
        if other is None or grad is None or other.device.type == "meta":
            raise AssertionError(f"{name}: gradient {other if other is None else other.device} on the offloaded "
                                 "base, expected a real one")
        if not _close(other, grad, tolerance):
            raise AssertionError(f"{name}: gradient differs (max abs diff {max_abs_diff(other, grad)})")
        if not _close(got["after"][name], want["after"][name], tolerance):
            raise AssertionError(f"{name}: updated value differs")
        worst = max(worst, max_abs_diff(other, grad))
    if got["loss"] != want["loss"]:  # the forward: bit-equal on every device
        raise AssertionError(f"loss differs: {got['loss']} vs {want['loss']}")
    return {"max_abs_diff": worst, "trainable": len(got["grads"]), "loss": got["loss"]}


def _base_unchanged(peft_model: Any, reference_logits: Any) -> None:
    import torch

    from ._models import device_input_ids

    base = peft_model.unload()
    base.eval()
    with torch.no_grad():
        logits = base(input_ids=device_input_ids()).logits
    if not torch.equal(logits, reference_logits):
        raise AssertionError("after the step and unload(), the offloaded base gives other logits than the untouched "
                             "base: base weights were changed")


def _logits(model: Any) -> Any:
    import torch

    from ._models import device_input_ids

    with torch.no_grad():
        return model.eval()(input_ids=device_input_ids()).logits


def _hashes_of(folder: Path) -> Dict[str, str]:
    from ._peft import _hashes

    return _hashes(folder) if folder.exists() else {}


def _run(workdir: Path, load_in_memory: Any, load_offloaded: Any, checkpoint: Path) -> Dict[str, Any]:
    from ._peft import _SideEffects

    want, _ = train_step(load_in_memory())
    untouched = _logits(load_in_memory())
    offloaded = load_offloaded()
    offload_before = _hashes_of(workdir / "offload")
    watch = _SideEffects(workdir, checkpoint, ("offload",))
    got, handles = train_step(offloaded)
    metrics = _compare_steps(got, want)
    _base_unchanged(handles["model"], untouched)
    problems = watch.problems()
    if _hashes_of(workdir / "offload") != offload_before:
        problems.append("offload folder files changed")
    if problems:
        raise AssertionError("the training step wrote: " + "; ".join(problems))
    return metrics


def fp32_step(workdir: Path) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ._device import to_device
    from ._models import save_tiny_llama
    from ._peft_tuners import offload_map

    checkpoint = save_tiny_llama(workdir / "base")
    return _run(workdir, lambda: to_device(AutoModelForCausalLM.from_pretrained(checkpoint)),
                lambda: AutoModelForCausalLM.from_pretrained(checkpoint, device_map=offload_map(),
                                                             offload_folder=str(workdir / "offload")),
                checkpoint)


def nf4_double_quant_step(workdir: Path) -> Dict[str, Any]:
    from ._bnb import base_checkpoint, dispatch, load_quantized, quant_config

    checkpoint = base_checkpoint(workdir)
    config = quant_config("nf4", True)
    return _run(workdir, lambda: load_quantized(checkpoint, config),
                lambda: dispatch(load_quantized(checkpoint, config), workdir), checkpoint)
