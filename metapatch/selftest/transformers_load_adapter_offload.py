"""Reproducers for ``transformers-load-adapter-offload``: transformers' own ``model.load_adapter(path)``
(``PeftAdapterMixin``, not PEFT's ``PeftModel``) over a base model offloaded to cpu/disk
(huggingface/transformers#33744).

A tiny Llama is saved as a random safetensors checkpoint and two LoRA adapters with non-zero weights
(``init_lora_weights=False``) are saved next to it. The base is loaded with a real
``from_pretrained(device_map=..., offload_folder=...)`` that puts layers 2 and 3 on disk (the adapters
target every decoder layer), and the adapters are loaded with ``model.load_adapter``. Logits and a short
greedy ``generate`` must equal (``torch.equal``) the in-memory base with the same adapters (on the execution
device, ``_device``, where the map's memory entries are too; ``_peft.offload_map``). Each run
also checks what loading wrote: the checkpoint and adapter files keep their hashes, the working
directory gains nothing, and in the work directory only the offload folder may change.

Upstream: transformers 5.x never loads the adapter tensors of disk-offloaded layers (NaN logits, or the
adapter's random initialisation); transformers 4.57 re-dispatches the model after loading and stops with
``RuntimeError: You can't move a model that has some modules offloaded to cpu or disk.``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Expect, Scenario

PATCH_ID = "transformers-load-adapter-offload"
_MODULE = "metapatch.selftest.transformers_load_adapter_offload"


def _prepare(workdir: Path) -> tuple:
    from ._models import save_tiny_llama
    from ._peft import save_adapter

    checkpoint = save_tiny_llama(workdir / "ckpt")
    first = save_adapter("llama", checkpoint, workdir / "adapter", seed=3)
    second = save_adapter("llama", checkpoint, workdir / "adapter2", seed=4)
    return checkpoint, first, second


def _offloaded(workdir: Path, source: Path) -> Any:
    """The model loaded from ``source`` (the base checkpoint, or an adapter folder whose config names it)
    with layers 2 and 3 on disk."""
    from transformers import AutoModelForCausalLM

    from ._peft import offload_map

    model = AutoModelForCausalLM.from_pretrained(source, device_map=offload_map("llama"),
                                                 offload_folder=str(workdir / "offload")).eval()
    if not any(p.is_meta for p in model.parameters()):
        raise AssertionError("the device map was meant to offload layers 2 and 3 to disk; nothing is on meta")
    return model


class _Untouched:
    """The side effects the load may not have: the checkpoint, the adapters and the working directory
    unchanged, nothing new in the work directory outside the offload folder."""

    def __init__(self, workdir: Path, checkpoint: Path, adapters: tuple):
        from ._peft import _hashes, _SideEffects

        self._hashes = _hashes
        self.watch = _SideEffects(workdir, checkpoint, ("offload",))
        self.adapters = {path: _hashes(path) for path in adapters}

    def check(self, label: str, error: BaseException = None) -> None:
        problems = self.watch.problems()
        problems += [f"adapter files in {path.name} modified" for path, hashes in self.adapters.items()
                     if self._hashes(path) != hashes]
        if problems:
            raised = f" (loading then raised {type(error).__name__}: {str(error)[:200]})" if error else ""
            raise AssertionError(f"{label}: loading wrote outside the offload folder: " + "; ".join(problems) + raised)


def _guarded(label: str, untouched: _Untouched, steps: Any) -> Dict[str, Any]:
    try:
        metrics = steps()
    except BaseException as exc:
        untouched.check(label, exc)
        raise
    untouched.check(label)
    return metrics


def _switching_unsupported() -> str:
    """Why transformers refuses set_adapter/enable_adapters/disable_adapters with the installed peft (5.24
    asks for peft >= 0.22 there, while load_adapter itself works with older peft), or ""."""
    try:
        from transformers.integrations.peft import MIN_PEFT_VERSION
        from transformers.utils.peft_utils import check_peft_version
    except ImportError:
        return ""
    try:
        check_peft_version(min_version=MIN_PEFT_VERSION)
    except ValueError as exc:
        return str(exc)
    return ""


def _in_memory(step: str, call: Any) -> Any:
    """Run the in-memory reference step; where it fails with an ImportError the installed transformers
    and peft do not work together at all (transformers 5.6-5.17's load_adapter imports a peft >= 0.19
    helper), which is no meta-device bug: the scenario is n/a on that stack, not FAILED."""
    from . import NotApplicable

    try:
        return call()
    except ImportError as exc:
        import importlib.metadata as md

        raise NotApplicable(f"{step} fails on the in-memory model too with transformers "
                            f"{md.version('transformers')} and peft {md.version('peft')} ({exc}): a version "
                            "incompatibility between them, not an offload bug") from exc


def load_adapter_offloaded(workdir: Path) -> Dict[str, Any]:
    """``model.load_adapter(path)``, then a second one with ``adapter_name=``, ``set_adapter``,
    ``disable_adapters``/``enable_adapters``, on a base with layers on disk. Where transformers refuses
    adapter switching with the installed peft (5.24 with peft < 0.22), the run stops after the second load."""
    from transformers import AutoModelForCausalLM

    from ._device import to_device
    from ._models import device_input_ids
    from ._peft import _compare, _logits_and_tokens

    checkpoint, first, second = _prepare(workdir)
    ids = device_input_ids()
    reference_model = to_device(AutoModelForCausalLM.from_pretrained(checkpoint).eval())
    plain = _logits_and_tokens(reference_model, ids)
    _in_memory("load_adapter", lambda: reference_model.load_adapter(str(first)))
    with_first = _logits_and_tokens(reference_model, ids)
    unsupported = _switching_unsupported()
    reference_model.load_adapter(str(second), adapter_name="second")
    if not unsupported:
        reference_model.set_adapter("second")
    with_second = _logits_and_tokens(reference_model, ids)
    del reference_model

    model = _offloaded(workdir, checkpoint)
    untouched = _Untouched(workdir, checkpoint, (first, second))

    def steps() -> Dict[str, Any]:
        metrics = {}
        model.load_adapter(str(first))
        metrics["load_adapter_max_abs_diff"] = _compare("load_adapter", _logits_and_tokens(model, ids), with_first)
        model.load_adapter(str(second), adapter_name="second")
        if unsupported:
            metrics["second_adapter_max_abs_diff"] = _compare("load_adapter(adapter_name='second')",
                                                              _logits_and_tokens(model, ids), with_second)
            metrics["set_adapter"] = f"not run: {unsupported}"
            return metrics
        model.set_adapter("second")
        metrics["set_adapter_max_abs_diff"] = _compare("load_adapter(adapter_name='second') + set_adapter",
                                                       _logits_and_tokens(model, ids), with_second)
        model.disable_adapters()
        metrics["disable_adapters_max_abs_diff"] = _compare("disable_adapters", _logits_and_tokens(model, ids), plain)
        model.enable_adapters()
        metrics["enable_adapters_max_abs_diff"] = _compare("enable_adapters", _logits_and_tokens(model, ids),
                                                           with_second)
        return metrics

    metrics = _guarded("load_adapter", untouched, steps)
    metrics["max_abs_diff"] = max(v for k, v in metrics.items() if k.endswith("max_abs_diff"))
    return metrics


def from_pretrained_adapter_dir(workdir: Path) -> Dict[str, Any]:
    """``AutoModelForCausalLM.from_pretrained(adapter_dir, device_map=..., offload_folder=...)``: transformers
    loads the base named in the adapter's config, dispatches it, then calls ``load_adapter`` itself."""
    from transformers import AutoModelForCausalLM

    from ._device import to_device
    from ._models import device_input_ids
    from ._peft import _compare, _logits_and_tokens

    checkpoint, first, _ = _prepare(workdir)
    ids = device_input_ids()
    reference = _logits_and_tokens(to_device(_in_memory("from_pretrained(adapter_dir)",
                                                        lambda: AutoModelForCausalLM.from_pretrained(first)).eval()), ids)
    untouched = _Untouched(workdir, checkpoint, (first,))
    model = _guarded("from_pretrained(adapter_dir)", untouched, lambda: _offloaded(workdir, first))
    if not getattr(model, "_hf_peft_config_loaded", False):
        raise AssertionError("from_pretrained(adapter_dir) did not load the adapter")
    diff = _compare("from_pretrained(adapter_dir)", _logits_and_tokens(model, ids), reference)
    untouched.check("from_pretrained(adapter_dir) then forward")
    return {"max_abs_diff": diff}


# Measured unpatched: 4.57 re-dispatches with a freshly inferred map and calls model.to; 5.0-5.3 load a
# direct load_adapter without the base's map, so every adapter tensor lands on cpu, which is right on a
# CPU-only machine (from_pretrained(adapter_dir) still passes the user's map); later releases differ.
_MOVE_REFUSED = Expect("RuntimeError", "You can't move a model that has some modules offloaded",
                       when={"transformers": "<5.0.0.dev0"})
_DIFFERS = "differ from the in-memory reference"

SCENARIOS = [
    Scenario(PATCH_ID, "load-adapter-offloaded", f"{_MODULE}:load_adapter_offloaded",
             "model.load_adapter(path) (transformers' PeftAdapterMixin) over a Llama with layers on disk, then a "
             "second adapter with adapter_name=, set_adapter, disable/enable_adapters: logits and greedy tokens "
             "equal the in-memory model; checkpoint, adapters and cwd untouched",
             expected_error="AssertionError", expected_message=_DIFFERS,
             unpatched=(_MOVE_REFUSED, Expect("", when={"transformers": ">=5.0.0.dev0,<5.4.0.dev0"}))),
    Scenario(PATCH_ID, "from-pretrained-adapter-dir", f"{_MODULE}:from_pretrained_adapter_dir",
             "AutoModelForCausalLM.from_pretrained(adapter_dir, device_map with disk, offload_folder=...): the "
             "same through transformers' own adapter loading in from_pretrained",
             expected_error="AssertionError", expected_message=_DIFFERS, unpatched=(_MOVE_REFUSED,)),
]
