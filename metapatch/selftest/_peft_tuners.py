"""Scenario functions of ``peft-offload-redispatch`` (declared in ``peft_offload_redispatch.py``)
across PEFT's tuners and entry points.

A tiny Llama (4 layers, hidden 64: every supported transformers has it) is saved as a random
checkpoint and loaded with layers 0-1 in memory and 2-3 on ``disk`` (``offload_folder`` in the work
directory); memory is the execution device (``_device``), and on a GPU machine layer 1 is offloaded to
``cpu`` (a GPU/cpu/disk map), the in-memory base on that GPU too. Each case builds the same adapter (non-zero: ``init_lora_weights=False`` /
``init_weights=False``) over that offloaded base and over the in-memory base, through one entry
point, and compares logits and greedy tokens with ``torch.equal``. A case passes when the results
are equal, or when metapatch refuses with a ``MetapatchError`` that the case allows; anything else
(a difference, an upstream error) fails the scenario, naming every failing case.

Every case also checks that nothing was written outside the offload folders and that the checkpoint
kept its hashes (:class:`metapatch.selftest._peft._SideEffects`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

_NEW_TOKENS = 3
_ATTENTION = ["q_proj", "v_proj"]
_MIXED = ["v_proj", "up_proj"]


# -- adapters --------------------------------------------------------------------------------------


def _boft_on_torch_ops() -> None:
    """BOFT on peft's torch path, never its CUDA kernel. peft builds that kernel (``cpp_extension.load``,
    nvcc) the first time a BOFT layer is made wherever torch is a CUDA build, GPU present or not: minutes
    where nvcc exists, and a build stopped half-way (a scenario's timeout) leaves a lock in
    ~/.cache/torch_extensions on which every later build waits forever (seen with torch 2.11+cu130 on a CPU
    machine: the scenario hung). peft itself takes the torch path where the build fails; the in-memory
    reference and the offloaded model both run it here, so the comparison is the same."""
    from peft.tuners.boft import layer

    if getattr(layer, "_FBD_CUDA", None) is None:
        layer._FBD_CUDA = False  # what get_fbd_cuda() returns from then on: "not available"


def tuner_config(kind: str) -> Any:
    """A non-zero adapter of each tuner users use, small enough for a tiny Llama."""
    import peft

    if kind == "lora":
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                               init_lora_weights=False)
    if kind == "rslora":
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=_ATTENTION, use_rslora=True,
                               init_lora_weights=False)
    if kind == "dora":
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=_ATTENTION, use_dora=True, init_lora_weights=False)
    if kind == "lora-modules-to-save":
        return peft.LoraConfig(r=4, target_modules=_ATTENTION, modules_to_save=["lm_head"], init_lora_weights=False)
    if kind == "lora-modules-to-save-offloaded":  # down_proj of the disk layers is copied too
        return peft.LoraConfig(r=4, target_modules=_ATTENTION, modules_to_save=["down_proj"], init_lora_weights=False)
    if kind == "lora-embedding":
        return peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)
    if kind == "ia3":
        return peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"],
                              init_ia3_weights=False)
    if kind == "loha":
        return peft.LoHaConfig(r=2, target_modules=_MIXED, init_weights=False)
    if kind == "lokr":
        return peft.LoKrConfig(r=2, target_modules=_MIXED, init_weights=False)
    if kind == "adalora":
        return peft.AdaLoraConfig(r=4, target_modules=_ATTENTION, init_lora_weights=False, total_step=10)
    if kind == "oft":
        return peft.OFTConfig(r=0, oft_block_size=8, target_modules=_ATTENTION, init_weights=False)
    if kind == "boft":
        _boft_on_torch_ops()
        return peft.BOFTConfig(boft_block_size=8, boft_n_butterfly_factor=1, target_modules=_ATTENTION,
                               init_weights=False)
    if kind == "vera":
        return peft.VeraConfig(r=4, target_modules=_ATTENTION, init_weights=False)
    raise ValueError(kind)


TUNERS = ("lora", "rslora", "dora", "lora-modules-to-save", "lora-modules-to-save-offloaded", "lora-embedding",
          "ia3", "loha", "lokr", "adalora", "oft", "boft", "vera")


def offload_map(embeddings_on_disk: bool = False) -> Dict[str, Any]:
    from ._peft import offload_map as llama_map

    device_map = llama_map("llama")
    if embeddings_on_disk:
        device_map["model.embed_tokens"] = "disk"
    return device_map


class _Bench:
    """The checkpoint, saved adapters (one per tuner, made once) and the in-memory references."""

    def __init__(self, workdir: Path) -> None:
        from ._models import save_tiny_llama

        self.workdir = workdir
        self.checkpoint = save_tiny_llama(workdir / "base")
        self._adapters: Dict[Tuple[str, int], Path] = {}
        self._runs = 0

    def base(self, offloaded: bool, embeddings_on_disk: bool = False) -> Any:
        from transformers import AutoModelForCausalLM

        if not offloaded:
            from ._device import to_device

            return to_device(AutoModelForCausalLM.from_pretrained(self.checkpoint).eval())
        self._runs += 1
        return AutoModelForCausalLM.from_pretrained(
            self.checkpoint, device_map=offload_map(embeddings_on_disk),
            offload_folder=str(self.workdir / "offload" / str(self._runs))).eval()

    def adapter(self, kind: str, seed: int = 3) -> Path:
        key = (kind, seed)
        if key not in self._adapters:
            import torch
            from peft import get_peft_model

            torch.manual_seed(seed)
            model = get_peft_model(self.base(offloaded=False), tuner_config(kind))
            path = self.workdir / "adapters" / f"{kind}-{seed}"
            model.save_pretrained(path)
            self._adapters[key] = path
        return self._adapters[key]


def outputs(model: Any, device: Any = None) -> Tuple[Any, Any]:
    """Logits and greedy tokens for the same prompt, fed on ``device`` (default: the execution device)."""
    import torch

    from ._models import input_ids

    if device is None:
        from ._device import execution_device

        device = execution_device()
    ids = input_ids().to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(input_ids=ids, max_new_tokens=_NEW_TOKENS, do_sample=False)
    return logits, tokens


def _same(got: Tuple[Any, Any], want: Tuple[Any, Any]) -> str:
    import torch

    from ._models import max_abs_diff

    if got[0].shape != want[0].shape or not torch.equal(got[0].cpu(), want[0].cpu()):
        diff = max_abs_diff(got[0], want[0]) if got[0].shape == want[0].shape else "shape"
        return f"logits differ (max abs diff {diff})"
    if not torch.equal(got[1].cpu(), want[1].cpu()):
        return f"greedy tokens differ: {got[1].tolist()} vs {want[1].tolist()}"
    return ""


# -- entry points: each returns (offloaded outputs, in-memory outputs) -------------------------------


def via_get_peft_model(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    import torch
    from peft import get_peft_model

    results = []
    for offloaded in (True, False):
        base = bench.base(offloaded, embeddings_on_disk=kind == "lora-embedding")
        torch.manual_seed(5)
        results.append(outputs(get_peft_model(base, tuner_config(kind)).eval()))
    return results[0], results[1]


def via_from_pretrained(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    from peft import PeftModel

    adapter = bench.adapter(kind)
    return tuple(outputs(PeftModel.from_pretrained(bench.base(offloaded, kind == "lora-embedding"), adapter).eval())
                 for offloaded in (True, False))


def via_load_adapter(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    from peft import PeftModel

    results = []
    for offloaded in (True, False):
        model = PeftModel.from_pretrained(bench.base(offloaded), bench.adapter(kind, seed=3))
        model.load_adapter(bench.adapter(kind, seed=4), adapter_name="second")
        model.set_adapter("second")
        results.append(outputs(model.eval()))
    return results[0], results[1]


def via_auto_peft_model(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    from peft import AutoPeftModelForCausalLM

    adapter = bench.adapter(kind)
    bench._runs += 1
    from ._device import to_device

    offloaded = AutoPeftModelForCausalLM.from_pretrained(
        adapter, device_map=offload_map(), offload_folder=str(bench.workdir / "offload" / f"auto{bench._runs}"))
    return outputs(offloaded.eval()), outputs(to_device(AutoPeftModelForCausalLM.from_pretrained(adapter)).eval())


def via_mixed_model(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    from peft import PeftMixedModel

    adapter = bench.adapter(kind)
    return tuple(outputs(PeftMixedModel.from_pretrained(bench.base(offloaded), adapter).eval())
                 for offloaded in (True, False))


def via_merge_and_unload(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    from peft import PeftModel

    adapter = bench.adapter(kind)
    return tuple(outputs(PeftModel.from_pretrained(bench.base(offloaded), adapter).merge_and_unload().eval())
                 for offloaded in (True, False))


def via_unload(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    from peft import PeftModel

    adapter = bench.adapter(kind)
    return tuple(outputs(PeftModel.from_pretrained(bench.base(offloaded), adapter).unload().eval())
                 for offloaded in (True, False))


def via_save_pretrained(bench: _Bench, kind: str) -> Tuple[Any, Any]:
    """The adapter saved from the offloaded model equals the one it was loaded from; the outputs
    compared are those of that saved adapter over the in-memory base and of the original."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    adapter = bench.adapter(kind)
    model = PeftModel.from_pretrained(bench.base(True), adapter)
    saved = bench.workdir / "offload" / f"saved-{kind}-{bench._runs}"
    model.save_pretrained(saved)
    want, got = load_file(adapter / "adapter_model.safetensors"), load_file(saved / "adapter_model.safetensors")
    if set(want) != set(got) or any(not torch.equal(want[k], got[k]) for k in want):
        raise AssertionError(f"the saved adapter differs from the loaded one: "
                             f"{sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))[:4]}")
    return tuple(outputs(PeftModel.from_pretrained(bench.base(False), path).eval()) for path in (saved, adapter))


ENTRY_POINTS: Dict[str, Callable[[_Bench, str], Tuple[Any, Any]]] = {
    "get_peft_model": via_get_peft_model,
    "PeftModel.from_pretrained": via_from_pretrained,
    "load_adapter+set_adapter": via_load_adapter,
    "AutoPeftModelForCausalLM": via_auto_peft_model,
    "PeftMixedModel": via_mixed_model,
    "merge_and_unload": via_merge_and_unload,
    "unload": via_unload,
    "save_pretrained": via_save_pretrained,
}


def run_cases(workdir: Path, cases: List[Tuple[str, str]], refusals: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """Run each (entry point, tuner) case; returns {case: "ok" | "refused: ..." | "FAILED: ..."}.
    ``refusals`` names the cases for which a MetapatchError is an accepted outcome."""
    from metapatch import MetapatchError

    from ._peft import _SideEffects

    bench = _Bench(workdir)
    watch = _SideEffects(workdir, bench.checkpoint, ("offload", "adapters"))
    results: Dict[str, Any] = {}
    for entry, kind in cases:
        name = f"{entry}/{kind}"
        try:
            got, want = ENTRY_POINTS[entry](bench, kind)
            problem = _same(got, want)
            results[name] = f"FAILED: {problem}" if problem else "ok"
        except MetapatchError as exc:
            results[name] = f"refused: {exc}"[:300] if name in refusals else f"FAILED: MetapatchError: {exc}"[:300]
        except Exception as exc:  # noqa: BLE001 - every case is reported, the scenario fails below
            results[name] = f"FAILED: {type(exc).__name__}: {exc}"[:300]
        problems = watch.problems()
        if problems:
            results[name] += " | wrote outside the offload folders: " + "; ".join(problems)
            watch = _SideEffects(workdir, bench.checkpoint, ("offload", "adapters"))
    return results


def check(results: Dict[str, Any]) -> Dict[str, Any]:
    failed = {k: v for k, v in results.items() if v.startswith("FAILED") or "wrote outside" in v}
    if failed:
        raise AssertionError(f"{len(failed)} of {len(results)} cases wrong over the offloaded base: "
                             + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    return results


# -- scenario functions ----------------------------------------------------------------------------


def tuners_from_pretrained(workdir: Path) -> Dict[str, Any]:
    return check(run_cases(workdir, [("PeftModel.from_pretrained", kind) for kind in TUNERS]))


def tuners_get_peft_model(workdir: Path) -> Dict[str, Any]:
    return check(run_cases(workdir, [("get_peft_model", kind) for kind in TUNERS]))


def lora_entry_points(workdir: Path) -> Dict[str, Any]:
    entries = [e for e in ENTRY_POINTS if e not in ("get_peft_model", "PeftModel.from_pretrained")]
    return check(run_cases(workdir, [(entry, "lora") for entry in entries]))


def all_disk_redispatch(workdir: Path) -> Dict[str, Any]:
    """``PeftModel.from_pretrained`` with a CPU budget too small for any layer: PEFT's re-dispatch
    map names only ``disk``. accelerate before 1.15 then refuses ("offload the whole model to the
    disk. Please use the disk_offload function instead"), advice a PEFT user cannot follow. A map of
    disk only computes on the CPU (on a GPU machine too, as ``dispatch_model`` decides): the in-memory
    reference computes where the re-dispatched model does."""
    from peft import PeftModel

    from ._peft import _SideEffects
    from ._tied import execution_device_of

    bench = _Bench(workdir)
    adapter = bench.adapter("lora")
    watch = _SideEffects(workdir, bench.checkpoint, ("offload", "adapters", "peft_offload"))
    model = PeftModel.from_pretrained(bench.base(True), adapter, max_memory={"cpu": 60_000},
                                      offload_dir=str(workdir / "peft_offload"))
    placement = set(map(str, model.hf_device_map.values()))
    device = execution_device_of(model)
    want = outputs(PeftModel.from_pretrained(bench.base(False).to(device), adapter).eval(), device)
    problem = _same(outputs(model.eval(), device), want)
    if problem:
        raise AssertionError(f"all-disk re-dispatch: {problem}")
    problems = watch.problems()
    if problems:
        raise AssertionError("all-disk re-dispatch wrote outside the offload folders: " + "; ".join(problems))
    return {"max_abs_diff": 0.0, "devices": sorted(placement)}
