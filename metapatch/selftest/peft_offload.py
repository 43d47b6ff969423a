"""Reproducers for ``peft-offload-redispatch`` (``accelerate-dispatch-skip-keys``' are in
``accelerate_dispatch_skip_keys.py``, on this module's Gemma 4 builders).

A tiny Llama and a tiny Gemma 4 (``Gemma4ForCausalLM``, text config with ``num_kv_shared_layers >
0``) are saved as random safetensors checkpoints, loaded with a device map that holds ``cpu`` and
``disk`` entries (``offload_folder`` in the work directory), and given a LoRA adapter with non-zero
weights (``init_lora_weights=False``) through ``PeftModel.from_pretrained``. Logits and a short
greedy ``generate`` are compared with the same adapter on the in-memory base.

Every scenario also checks what the load wrote: the checkpoint's files must keep their hashes, the
working directory must not gain anything, and inside the work directory only the offload folders
may change. The side-effect check runs even when loading raises, so the data loss of
``_update_offload`` (it rewrites the checkpoint from ``/``, copies it elsewhere) is reported first.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Dict, Optional

from ._harness import Scenario

REDISPATCH = "peft-offload-redispatch"
_MODULE = "metapatch.selftest.peft_offload"
_NEW_TOKENS = 4


# -- tiny models ---------------------------------------------------------------------------------


def require_gemma4() -> None:
    """Gemma 4 arrived in transformers 5.5.0: on older releases its scenarios are not applicable."""
    import transformers

    from . import NotApplicable

    if not hasattr(transformers, "Gemma4ForCausalLM"):
        raise NotApplicable(f"needs transformers >= 5.5 (Gemma4ForCausalLM); installed {transformers.__version__}")


def tiny_gemma4_config() -> Any:
    """A Gemma 4 text config small enough for seconds on CPU; the last 3 of 6 layers reuse the KV of
    earlier layers (``num_kv_shared_layers``), which is what accelerate's dict copies break."""
    require_gemma4()
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, num_kv_shared_layers=3, sliding_window=16,
        max_position_embeddings=64, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    )


def save_tiny_gemma4(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    Gemma4ForCausalLM(tiny_gemma4_config()).eval().save_pretrained(path)
    return path


def _save_checkpoint(arch: str, path: Path) -> Path:
    if arch == "gemma4":
        return save_tiny_gemma4(path)
    from ._models import save_tiny_llama

    return save_tiny_llama(path)


def offload_map(arch: str) -> Dict[str, str]:
    """Embeddings, head and the first layers in memory; the last layers on disk. For Gemma 4 the
    disk layers include KV-shared ones and their sources (layers 3-5 reuse 1 and 2)."""
    layers = 4 if arch == "llama" else 6
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    if arch == "gemma4":
        device_map.update({"model.embed_tokens_per_layer": "cpu", "model.per_layer_model_projection": "cpu",
                           "model.per_layer_projection_norm": "cpu"})
    for i in range(layers):
        device_map[f"model.layers.{i}"] = "cpu" if i < 2 else "disk"
    return device_map


def save_adapter(arch: str, checkpoint: Path, path: Path, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(path)
    return path


# -- side effects --------------------------------------------------------------------------------


def _hashes(folder: Path) -> Dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _listing(folder: Path, recursive: bool, skip: Optional[Path] = None) -> set:
    if not recursive:
        return set(os.listdir(folder))
    found = set()
    for root, dirs, files in os.walk(folder):
        if skip is not None:
            dirs[:] = [d for d in dirs if Path(root, d) != skip]
        found.update(os.path.relpath(os.path.join(root, name), folder) for name in dirs + files)
    return found


class _SideEffects:
    """What the load may not touch: the checkpoint, the working directory, the work directory
    outside the offload folders."""

    def __init__(self, workdir: Path, checkpoint: Path, offload_folders: tuple):
        self.workdir, self.checkpoint = workdir, checkpoint
        self.cwd = Path(os.getcwd()).resolve()
        # "/" is listed one level deep only: the bug's writes there land inside existing folders
        # (tmp/...), which the checkpoint hash catches.
        self.recursive_cwd = self.cwd != Path("/")
        self.allowed = tuple(workdir / name for name in offload_folders)
        self.before = self._snapshot()

    def _snapshot(self) -> tuple:
        work = {p for p in _listing(self.workdir, True)
                if not any((self.workdir / p).is_relative_to(a) for a in self.allowed)}
        inside = self.workdir.resolve().is_relative_to(self.cwd)
        cwd = _listing(self.cwd, self.recursive_cwd, skip=self.workdir.resolve() if inside else None)
        return _hashes(self.checkpoint), work, cwd

    def problems(self) -> list:
        hashes, work, cwd = self._snapshot()
        found = []
        if hashes != self.before[0]:
            changed = sorted(k for k in set(hashes) | set(self.before[0]) if hashes.get(k) != self.before[0].get(k))
            found.append(f"checkpoint files modified in place: {changed}")
        if work - self.before[1]:
            new = sorted(work - self.before[1])[:5]
            found.append(f"new files in the work directory outside the offload folders: {new}")
        if cwd - self.before[2]:
            found.append(f"new files in the working directory {self.cwd}: {sorted(cwd - self.before[2])[:5]}")
        return found


# -- the runs ----------------------------------------------------------------------------------


def _logits_and_tokens(model: Any, ids: Any) -> tuple:
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(input_ids=ids, max_new_tokens=_NEW_TOKENS, do_sample=False)
    return logits, tokens


def _compare(name: str, got: tuple, want: tuple) -> float:
    import torch

    from ._models import max_abs_diff

    diff = max_abs_diff(got[0], want[0])
    if not torch.equal(got[0], want[0]):
        raise AssertionError(f"{name}: logits differ from the in-memory reference (max abs diff {diff})")
    if not torch.equal(got[1], want[1]):
        raise AssertionError(f"{name}: greedy tokens differ: {got[1].tolist()} vs {want[1].tolist()}")
    return diff


def _reference(arch: str, checkpoint: Path, adapters: list) -> tuple:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ._models import input_ids

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), adapters[0]).eval()
    ids = input_ids()
    first = _logits_and_tokens(model, ids)
    if len(adapters) == 1:
        return first, None, None
    model.load_adapter(adapters[1], adapter_name="second")
    model.set_adapter("second")
    second = _logits_and_tokens(model, ids)
    merged = _logits_and_tokens(model.merge_and_unload(), ids)
    return first, second, merged


def _peft_kwargs(kind: str, workdir: Path, arch: str) -> Dict[str, Any]:
    if kind == "default":
        return {}
    if kind == "max-memory-small":
        # Room for about half the model: the rest goes to disk, which needs a folder of its own.
        budget = 400_000 if arch == "llama" else 500_000
        return {"max_memory": {"cpu": budget}, "offload_dir": str(workdir / "peft_offload")}
    if kind == "max-memory-large":
        return {"max_memory": {"cpu": 10 ** 9}}
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

    from ._models import input_ids

    workdir.mkdir()
    base = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=offload_map(arch),
                                                offload_folder=str(workdir / "offload"))
    watch = _SideEffects(workdir, checkpoint, ("offload", "peft_offload"))
    offload_files = _listing(workdir / "offload", True) if (workdir / "offload").exists() else set()
    metrics: Dict[str, Any] = {}
    try:
        model = PeftModel.from_pretrained(base, adapters[0], **_peft_kwargs(kind, workdir, arch)).eval()
        ids = input_ids()
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

    from ._models import input_ids, max_abs_diff, save_tiny_llama

    if not torch.cuda.is_available():
        raise RuntimeError("this scenario needs a CUDA device")
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


def _scenario(patch_id: str, name: str, func: str, description: str, error: str, in_selftest: bool = True) -> Scenario:
    return Scenario(patch_id, name, f"{_MODULE}:{func}", description, expected_error=error, in_selftest=in_selftest)


_WAYS = ("PeftModel.from_pretrained with no extra kwargs, with small and large max_memory, with the base's "
         "own device_map (the seed); then a second adapter (load_adapter + set_adapter) and merge_and_unload")

SCENARIOS = [
    _scenario(REDISPATCH, "llama", "llama",
              "Llama offloaded to cpu/disk + LoRA adapter: " + _WAYS + ". Upstream rewrites the checkpoint into "
              "a relative path (a copy under the working directory; the checkpoint itself from /), then "
              "model.to() meets the disk weights on meta", "AssertionError"),
    _scenario(REDISPATCH, "gemma4", "gemma4",
              "Gemma 4 with KV-shared layers offloaded to cpu/disk + LoRA adapter: " + _WAYS, "AssertionError"),
    _scenario(REDISPATCH, "gpu-4bit-cpu-parts", "gpu_4bit_cpu_parts",
              "one GPU: 4-bit decoder on cuda:0, unquantized parts on cpu (the seed's layout), then the adapter",
              "", in_selftest=False),
]
