"""Reproducers for ``peft-offload-redispatch``: every scenario of the patch, in the order the
default selftest runs them (inference here; one training step in ``_peft_training.py``; PEFT's
tuners and entry points in ``_peft_tuners.py``; builders shared with
``accelerate_dispatch_skip_keys.py`` and the benchmarks in ``_peft.py``).

A tiny Llama and a tiny Gemma 4 (``Gemma4ForCausalLM``, text config with ``num_kv_shared_layers >
0``) are saved as random safetensors checkpoints, loaded with a device map that holds ``cpu`` and
``disk`` entries (``offload_folder`` in the work directory), and given a LoRA adapter with non-zero
weights (``init_lora_weights=False``) through ``PeftModel.from_pretrained``. Logits and a short
greedy ``generate`` are compared with the same adapter on the in-memory base. The map's memory entries
and the in-memory base are on the execution device (``_device``; on a GPU machine the map is GPU 0, cpu
and disk: ``_peft.offload_map``), and PEFT's ``max_memory`` budgets are given there
(``_device.memory_budget``).

Every scenario also checks what the load wrote: the checkpoint's files must keep their hashes, the
working directory must not gain anything, and inside the work directory only the offload folders
may change. The side-effect check runs even when loading raises, so the data loss of
``_update_offload`` (it rewrites the checkpoint from ``/``, copies it elsewhere) is reported first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from . import NotApplicable
from ._harness import Expect, Scenario
from ._peft_training import GPU_STEP_REASON, GPU_STEP_TOLERANCE
from ._peft import (_compare, _listing, _logits_and_tokens, _save_checkpoint, _SideEffects, offload_map,
                    require_gemma4, save_adapter)

REDISPATCH = "peft-offload-redispatch"
_MODULE = "metapatch.selftest.peft_offload_redispatch"
_TRAINING = "metapatch.selftest._peft_training"
_TUNERS = "metapatch.selftest._peft_tuners"


# -- the runs ----------------------------------------------------------------------------------


def _reference(arch: str, checkpoint: Path, adapters: list) -> tuple:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ._device import to_device
    from ._models import device_input_ids

    model = PeftModel.from_pretrained(to_device(AutoModelForCausalLM.from_pretrained(checkpoint)), adapters[0]).eval()
    ids = device_input_ids()
    first = _logits_and_tokens(model, ids)
    if len(adapters) == 1:
        return first, None, None
    model.load_adapter(adapters[1], adapter_name="second")
    model.set_adapter("second")
    second = _logits_and_tokens(model, ids)
    merged = _logits_and_tokens(model.merge_and_unload(), ids)
    return first, second, merged


def _peft_kwargs(kind: str, workdir: Path, arch: str) -> Dict[str, Any]:
    from ._device import memory_budget

    if kind == "default":
        return {}
    if kind == "max-memory-small":
        # Room for about half the model: the rest goes to disk, which needs a folder of its own.
        budget = 400_000 if arch == "llama" else 500_000
        return {"max_memory": memory_budget(budget), "offload_dir": str(workdir / "peft_offload")}
    if kind == "max-memory-large":
        return {"max_memory": memory_budget(10 ** 9)}
    if kind == "low-cpu-mem-usage":
        # PEFT creates the adapter on meta and assigns the loaded values (no random init first).
        return {"low_cpu_mem_usage": True}
    if kind == "seed-device-map":
        # What the seed's user did: the base model's own map passed again to PEFT.
        return {"device_map": offload_map(arch)}
    raise ValueError(kind)


KINDS = ("default", "max-memory-small", "max-memory-large", "seed-device-map", "low-cpu-mem-usage")
# Kinds that also load a second adapter and merge (the first kind always does).
_SECOND_ADAPTER_KINDS = ("low-cpu-mem-usage",)


def run_offloaded_peft(workdir: Path, arch: str, kinds: tuple = KINDS, second_adapter: bool = True) -> Dict[str, Any]:
    """Every way of loading the adapter over the offloaded base, in one process (interpreter start-up
    dominates the cost). Stops at the first wrong result, naming the way that failed."""
    checkpoint = _save_checkpoint(arch, workdir / "base")
    adapters = [save_adapter(arch, checkpoint, workdir / "adapter", seed=3)]
    if second_adapter:
        adapters.append(save_adapter(arch, checkpoint, workdir / "adapter2", seed=4))
    reference = _reference(arch, checkpoint, adapters)
    metrics: Dict[str, Any] = {}
    for n, kind in enumerate(kinds):
        metrics.update(_load_offloaded(workdir / f"run{n}", arch, kind, checkpoint,
                                       adapters if n == 0 or kind in _SECOND_ADAPTER_KINDS else adapters[:1],
                                       reference))
    metrics["max_abs_diff"] = max(v for k, v in metrics.items() if k.endswith("max_abs_diff"))
    return metrics


def _load_offloaded(workdir: Path, arch: str, kind: str, checkpoint: Path, adapters: list,
                    reference: tuple) -> Dict[str, Any]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ._models import device_input_ids

    workdir.mkdir()
    base = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=offload_map(arch),
                                                offload_folder=str(workdir / "offload"))
    watch = _SideEffects(workdir, checkpoint, ("offload", "peft_offload"))
    offload_files = _listing(workdir / "offload", True) if (workdir / "offload").exists() else set()
    metrics: Dict[str, Any] = {}
    try:
        model = PeftModel.from_pretrained(base, adapters[0], **_peft_kwargs(kind, workdir, arch)).eval()
        ids = device_input_ids()
        metrics[f"{kind}:max_abs_diff"] = _compare(f"{kind}: adapter", _logits_and_tokens(model, ids), reference[0])
        if len(adapters) > 1:
            empty = {"low_cpu_mem_usage": True} if kind == "low-cpu-mem-usage" else {}
            model.load_adapter(adapters[1], adapter_name="second", **empty)
            model.set_adapter("second")
            metrics[f"{kind}:second_adapter_max_abs_diff"] = _compare(
                f"{kind}: second adapter", _logits_and_tokens(model, ids), reference[1])
            metrics.update(_merge(model, ids, reference[2], kind))
    except BaseException as exc:
        problems = watch.problems()
        if problems:
            raise AssertionError(f"{kind}: PEFT wrote outside the offload folder: " + "; ".join(problems)
                                 + f" (the load then raised {type(exc).__name__}: {str(exc)[:200]})") from exc
        raise
    problems = watch.problems()
    if problems:
        raise AssertionError(f"{kind}: PEFT wrote outside the offload folder: " + "; ".join(problems))
    now = _listing(workdir / "offload", True) if (workdir / "offload").exists() else set()
    if now - offload_files:
        raise AssertionError(f"{kind}: base weights were offloaded again: new files {sorted(now - offload_files)[:5]}")
    return metrics


def _merge(model: Any, ids: Any, reference: tuple, kind: str) -> Dict[str, Any]:
    """merge_and_unload on an offloaded model either works (same outputs as merging in memory) or
    says clearly why it cannot; anything else fails the scenario."""
    from metapatch import MetapatchError

    try:
        merged = model.merge_and_unload()
    except MetapatchError as exc:
        return {f"{kind}:merge": f"refused: {exc}"[:200]}
    diff = _compare(f"{kind}: merge_and_unload", _logits_and_tokens(merged, ids), reference)
    return {f"{kind}:merge": "ok", f"{kind}:merge_max_abs_diff": diff}


# -- scenario functions (module:function names are what Scenario records) ------------------------


def llama(workdir: Path) -> Dict[str, Any]:
    return run_offloaded_peft(workdir, "llama")


def gemma4(workdir: Path) -> Dict[str, Any]:
    require_gemma4()
    return run_offloaded_peft(workdir, "gemma4")


def gpu_4bit_cpu_parts(workdir: Path) -> Dict[str, Any]:
    """The seed's layout on one GPU: decoder layers quantized to 4-bit (nf4, double quant) on cuda:0,
    the unquantized parts (embeddings, final norm, head: the vision/audio towers' role) on cpu, then
    the adapter. Compared with the same adapter on the same 4-bit base entirely on cuda:0 (the cpu
    parts run on cuda:0 either way, so the arithmetic is the same)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ._device import on_gpu
    from ._models import input_ids, max_abs_diff, save_tiny_llama

    if not on_gpu():
        raise NotApplicable("needs a CUDA device (the execution device is the CPU here)")
    checkpoint = save_tiny_llama(workdir / "base")
    adapter = save_adapter("llama", checkpoint, workdir / "adapter", seed=3)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, llm_int8_enable_fp32_cpu_offload=True)
    ids = input_ids().to("cuda:0")
    reference_base = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quant, device_map={"": 0})
    reference = _logits_and_tokens(PeftModel.from_pretrained(reference_base, adapter).eval(), ids)

    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": 0,
                  "model.layers": 0}
    base = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quant, device_map=device_map,
                                                offload_folder=str(workdir / "offload"))
    watch = _SideEffects(workdir, checkpoint, ("offload",))
    model = PeftModel.from_pretrained(base, adapter).eval()
    got = _logits_and_tokens(model, ids)
    problems = watch.problems()
    if problems:
        raise AssertionError("PEFT wrote outside the offload folder: " + "; ".join(problems))
    diff = max_abs_diff(got[0], reference[0])
    if not torch.allclose(got[0], reference[0], atol=1e-5, rtol=1e-5):
        raise AssertionError(f"logits differ from the all-cuda 4-bit reference (max abs diff {diff})")
    if not torch.equal(got[1], reference[1]):
        raise AssertionError(f"greedy tokens differ: {got[1].tolist()} vs {reference[1].tolist()}")
    placement = {k: str(v) for k, v in model.hf_device_map.items()}
    if "cpu" not in placement.values():
        raise AssertionError(f"the cpu parts were moved: {placement}")
    return {"max_abs_diff": diff, "hf_device_map": placement}


def _scenario(patch_id: str, name: str, func: str, description: str, error: str, in_selftest: bool = True,
              unpatched: tuple = ()) -> Scenario:
    return Scenario(patch_id, name, f"{_MODULE}:{func}", description, expected_error=error, in_selftest=in_selftest,
                    unpatched=unpatched)


# peft < 0.20 (measured: 0.17.0, 0.18.0, 0.19.1; 0.21.2 does not) fails earlier, in its own re-dispatch: the device
# map it builds for the adapter names the model's modules under the PeftModel's prefix (KeyError
# 'base_model.model.model.lm_head'), before the checkpoint is rewritten; on every CPU release before it fails too.
_EARLY_PEFT = Expect("KeyError", r"base_model\.model\.", when={"peft": "<0.20.0"})


_WAYS = ("PeftModel.from_pretrained with no extra kwargs, with small and large max_memory, with the base's "
         "own device_map (the seed); then a second adapter (load_adapter + set_adapter) and merge_and_unload")


def _tuners(name: str, func: str, description: str, error: str) -> Scenario:
    return Scenario(REDISPATCH, name, f"{_TUNERS}:{func}", description, expected_error=error)


SCENARIOS = [
    _scenario(REDISPATCH, "llama", "llama",
              "Llama offloaded to cpu/disk + LoRA adapter: " + _WAYS + ". Upstream rewrites the checkpoint into "
              "a relative path (a copy under the working directory; the checkpoint itself from /), then "
              "model.to() meets the disk weights on meta", "AssertionError", unpatched=(_EARLY_PEFT,)),
    _scenario(REDISPATCH, "gemma4", "gemma4",
              "Gemma 4 with KV-shared layers offloaded to cpu/disk + LoRA adapter: " + _WAYS, "AssertionError",
              unpatched=(_EARLY_PEFT,)),
    _scenario(REDISPATCH, "gpu-4bit-cpu-parts", "gpu_4bit_cpu_parts",
              "one GPU: 4-bit decoder on cuda:0, unquantized parts on cpu (the seed's layout), then the adapter",
              "", in_selftest=False),
    Scenario(REDISPATCH, "train-step-fp32", f"{_TRAINING}:fp32_step",
             "one LoRA SGD step over a Llama with layers 2-3 on disk: gradients and updates equal to the "
             "in-memory step, base weights, checkpoint and offload files unchanged; upstream the adapters of the disk "
             "layers are on meta (MmBackward0 returned an invalid gradient ... expected device meta)",
             expected_error="RuntimeError", gpu_tolerance=GPU_STEP_TOLERANCE, tolerance_reason=GPU_STEP_REASON),
    Scenario(REDISPATCH, "train-step-nf4", f"{_TRAINING}:nf4_double_quant_step",
             "one LoRA SGD step over a 4-bit nf4 double-quant Llama with layers 2-3 dispatched to disk (upstream the "
             "dispatch already fails: Tensor.item() on meta, bnb-quant-state-offload; with that patch alone the "
             "gradients through the offloaded 4-bit layers are NaN)", expected_error="RuntimeError",
             gpu_tolerance=GPU_STEP_TOLERANCE, tolerance_reason=GPU_STEP_REASON),
    _tuners("tuners-from-pretrained", "tuners_from_pretrained",
            "Llama with layers 2-3 on disk + PeftModel.from_pretrained of a non-zero adapter of every tuner "
            "(LoRA, rsLoRA, DoRA, modules_to_save in memory and on disk, embedding LoRA on disk, IA3, LoHa, LoKr, AdaLoRA, OFT, BOFT, VeRA): "
            "logits and greedy tokens equal to the in-memory model", "AssertionError"),
    _tuners("tuners-get-peft-model", "tuners_get_peft_model",
            "Llama with layers 2-3 on disk + get_peft_model with a non-zero adapter of every tuner: upstream "
            "leaves the adapters of offloaded layers on meta (silently wrong logits)", "AssertionError"),
    _tuners("all-disk-redispatch", "all_disk_redispatch",
            "PeftModel.from_pretrained(offloaded Llama, LoRA, max_memory={'cpu': 60_000}, offload_dir=...): the "
            "re-dispatch map names only disk; accelerate < 1.15 refuses it (ValueError: offload the whole model "
            "to the disk)", "ValueError"),
    _tuners("lora-entry-points", "lora_entry_points",
            "Llama with layers 2-3 on disk + LoRA through load_adapter/set_adapter, AutoPeftModelForCausalLM, "
            "PeftMixedModel, merge_and_unload, unload and save_pretrained", "AssertionError"),
]
