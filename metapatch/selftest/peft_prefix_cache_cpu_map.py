"""Reproducers for peft-prefix-cache-cpu-map: prefix tuning over a base whose device map names no accelerator.

A tiny random Llama and a prefix-tuning adapter with random (non-zero) virtual tokens, saved; the reference
is ``PeftModel.from_pretrained`` over the in-memory base. The base is then loaded with a real
``from_pretrained(device_map=...)``: layers on cpu and disk with an ``offload_folder`` (``cpu-disk-map``), or
``{"": "cpu"}`` (``cpu-map``, nothing offloaded: the reporter's case, huggingface/peft#3619), and gets the same
adapter through ``get_peft_model`` and the saved state dict (``PeftModel.from_pretrained`` over an offloaded
base needs ``peft-offload-redispatch`` too; this patch's diff alone must fix its scenarios). Fixed means
logits and a greedy ``generate`` equal the in-memory PeftModel's (torch.equal), and the checkpoint, the
adapter folder and the offload folder are as the loads left them. Upstream fails at the first forward,
where ``get_layer_device_map`` looks for the map's accelerator: ``StopIteration`` (peft 0.21) or
``IndexError`` (earlier releases). transformers 5 sets no ``hf_device_map`` for a single-device map, so
``cpu-map`` shows the bug on transformers 4.57 only.

Both scenarios compute on the CPU on every machine: the bug is a map without an accelerator, and such a
map computes on the CPU (a GPU machine's map names its GPU, where upstream works).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Expect, Scenario
from ._models import input_ids, save_tiny_llama

PATCH_ID = "peft-prefix-cache-cpu-map"
_VIRTUAL_TOKENS = 3
_NEW_TOKENS = 4
_CPU_ONLY = ("the bug is a device map without an accelerator (device_map='cpu', cpu/disk offload): such a map "
             "computes on the CPU on any machine")


def _cpu_disk_map(layers: int) -> Dict[str, Any]:
    device_map: Dict[str, Any] = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu",
                                  "lm_head": "disk"}
    device_map.update({f"model.layers.{i}": ("disk" if i % 2 else "cpu") for i in range(layers)})
    return device_map


def _files(folder: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _outputs(model: Any, ids: Any) -> tuple:
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=_NEW_TOKENS,
                                do_sample=False)
    return logits, tokens


def _run(workdir: Path, device_map: Any) -> Dict[str, Any]:
    import torch
    from peft import PeftModel, PrefixTuningConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from transformers import LlamaForCausalLM

    checkpoint = save_tiny_llama(workdir / "base")
    torch.manual_seed(1)  # the prefix embedding's random init: non-zero virtual tokens
    adapter = get_peft_model(LlamaForCausalLM.from_pretrained(checkpoint),
                             PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=_VIRTUAL_TOKENS))
    adapter.save_pretrained(workdir / "adapter")
    ids = input_ids()
    reference = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(checkpoint), workdir / "adapter").eval()
    want_logits, want_tokens = _outputs(reference, ids)
    if float(reference.prompt_encoder["default"].embedding.weight.abs().max()) == 0:
        raise AssertionError("the adapter's virtual tokens are zero: the comparison would prove nothing")
    before = {name: _files(workdir / name) for name in ("base", "adapter")}

    offload = workdir / "offload"
    layers = reference.config.num_hidden_layers
    base = LlamaForCausalLM.from_pretrained(checkpoint, device_map=device_map(layers) if callable(device_map)
                                            else device_map, offload_folder=str(offload))
    model = get_peft_model(base, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=_VIRTUAL_TOKENS))
    set_peft_model_state_dict(model, load_peft_weights(str(workdir / "adapter")))
    model.eval()
    offloaded_before = _files(offload) if offload.exists() else {}
    got_logits, got_tokens = _outputs(model, ids)
    if not torch.equal(got_logits, want_logits):
        raise AssertionError(f"logits differ: max abs diff {float((got_logits - want_logits).abs().max())}")
    if not torch.equal(got_tokens, want_tokens):
        raise AssertionError(f"generate gave {got_tokens.tolist()}, in memory {want_tokens.tolist()}")
    if {name: _files(workdir / name) for name in ("base", "adapter")} != before:
        raise AssertionError("the checkpoint or the adapter folder changed")
    if (_files(offload) if offload.exists() else {}) != offloaded_before:
        raise AssertionError("the offload folder changed after loading")
    return {"max_abs_diff": 0.0, "devices": sorted({str(d) for d in getattr(base, "hf_device_map", {}).values()}),
            "generated_tokens": int(got_tokens.shape[-1] - ids.shape[-1])}


def cpu_disk_map(workdir: Path) -> Dict[str, Any]:
    return _run(workdir, _cpu_disk_map)


def cpu_map(workdir: Path) -> Dict[str, Any]:
    return _run(workdir, {"": "cpu"})


# peft 0.17 predates transformers 4.56's Cache.layers: there prefix tuning over any device map (a GPU's too)
# fails in map_cache_to_layer_device_map with "'DynamicCache' object has no attribute 'key_cache'".
_UPSTREAM = dict(expected_error="StopIteration|IndexError", device="cpu", device_reason=_CPU_ONLY,
                 requires={"peft": ">=0.18"})

SCENARIOS = [
    Scenario(PATCH_ID, "cpu-disk-map", f"{__name__}:cpu_disk_map",
             "a saved prefix-tuning adapter over a base with layers on cpu and disk: logits and generate equal the "
             "in-memory PeftModel (unpatched: StopIteration or IndexError at the first forward)",
             quick=True, **_UPSTREAM),
    Scenario(PATCH_ID, "cpu-map", f"{__name__}:cpu_map",
             "the same over a base loaded with device_map={'': 'cpu'} (nothing offloaded, peft#3619): logits and "
             "generate equal the in-memory PeftModel (unpatched: IndexError on transformers 4.57; transformers 5 "
             "keeps no map for one device)",
             unpatched=(Expect("", when={"transformers": ">=5.0.0.dev0"}),), **_UPSTREAM),
]
