"""Reproducers: bitsandbytes' in-place CPU repacking of 4-bit weights (patch ``bnb-cpu-repack-copy``).

On a CPU with AVX512-BF16, bitsandbytes >= 0.49 repacks a 4-bit weight for its fused kernel at the
first eval-mode forward whose input needs no grad. Every scenario reports ``cpu_repack`` (whether
this CPU takes that path) and prints it: on a CPU without AVX512-BF16 the same checks run on the
portable kernel, and upstream passes them (nothing is repacked), which the tests assert instead of
skipping; the metric ``not_reproducible_here`` then says why (``metapatch selftest`` reports n/a).

The repack is a path of bitsandbytes' CPU library, which it loads only where CUDA is absent (its CUDA
library has no AVX512-BF16 probe): the scenarios are pinned to the CPU (CUDA hidden from their process),
so a GPU machine shows the bug exactly as a CPU-only one with the same CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from ._harness import Scenario

PATCH_ID = "bnb-cpu-repack-copy"
_CPU_LIBRARY = {"device": "cpu", "device_reason": "bitsandbytes' CPU weight repacking (AVX512-BF16), a path of its "
                                                  "CPU library, which it loads only where CUDA is absent"}
NO_REPACK = "bitsandbytes does not repack 4-bit weights on this CPU (no AVX512-BF16): the bug's path is not taken"


def cpu_repack() -> bool:
    """Whether bitsandbytes repacks 4-bit weights on this CPU (its own probe); printed so that a
    log says which path ran."""
    import bitsandbytes.functional as F

    found = bool(getattr(F, "_convert_weight_packed_for_cpu", None)) and bool(F.has_avx512bf16())
    print(f"bitsandbytes CPU repack path: {'yes' if found else 'no (portable kernel only)'}")
    return found


def _path_taken(repack: bool) -> Dict[str, str]:
    """The metric that tells ``metapatch selftest`` why an unpatched pass proves nothing here."""
    return {} if repack else {"not_reproducible_here": NO_REPACK}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_bytes(tensor: Any) -> bytes:
    import torch

    tensor = tensor.detach().cpu().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def _digest(state: Dict[str, Any]) -> Dict[str, Tuple[str, str, Tuple[int, ...]]]:
    return {k: (str(v.dtype), _sha256(_tensor_bytes(v)), tuple(v.shape)) for k, v in state.items()}


def _assert_same_bytes(expected: Dict[str, Any], found: Dict[str, Any], what: str) -> int:
    want, got = _digest(expected), _digest(found)
    if set(want) != set(got):
        raise AssertionError(f"{what}: keys differ: {sorted(set(want) ^ set(got))[:6]}")
    changed = sorted(k for k in want if want[k] != got[k])
    if changed:
        raise AssertionError(f"{what}: {len(changed)} of {len(want)} tensors differ from what was loaded "
                             f"(dtype/bytes/shape), e.g. {changed[:3]}")
    return len(want)


# ---------------------------------------------------------------------------------------------
# Training after evaluation


def _lora_grads(path: Path, evaluate_first: bool) -> Tuple[Dict[str, Any], Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    from ._models import input_ids
    from ._bnb import load_quantized, quant_config

    model = load_quantized(path, quant_config("nf4", True, "float32"))
    torch.manual_seed(3)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = input_ids()
    evaluated = None
    if evaluate_first:
        model.eval()
        with torch.no_grad():
            evaluated = model(ids).logits
    model.train()
    model(ids).logits.float().pow(2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, evaluated


def training_after_eval(workdir: Path) -> Dict[str, Any]:
    """QLoRA (nf4 double quant, LoRA on q/v): one ``no_grad`` eval forward, then a training
    forward/backward; every LoRA gradient equals the one of a model never evaluated. Unpatched
    on a repacking CPU the layers run the repacked kernel (no backward): ``grad None``."""
    from ._models import max_abs_diff
    from ._bnb import base_checkpoint

    repack = cpu_repack()
    path = base_checkpoint(workdir)
    reference, _ = _lora_grads(path, evaluate_first=False)
    grads, evaluated = _lora_grads(path, evaluate_first=True)
    # in every message, so that an unpatched run still tells what its evaluation computed
    logits_sha = _sha256(_tensor_bytes(evaluated))
    missing = sorted(n for n, g in grads.items() if g is None)
    if any(g is None for g in reference.values()):
        raise AssertionError("the never-evaluated reference has LoRA parameters without a gradient")
    if missing:
        raise AssertionError(f"after one no_grad forward, {len(missing)} of {len(grads)} LoRA parameters get "
                             f"grad None (e.g. {missing[0]}): training trains nothing [eval logits sha256 {logits_sha}]")
    diff = max(max_abs_diff(grads[n], reference[n]) for n in reference)
    unequal = sorted(n for n in reference if not grads[n].equal(reference[n]))
    if unequal:
        raise AssertionError(f"after one no_grad forward, {len(unequal)} LoRA gradients differ from a model "
                             f"never evaluated (max abs diff {diff}), e.g. {unequal[0]} [eval logits sha256 {logits_sha}]")
    return {"max_abs_diff": diff, "cpu_repack": repack, "lora_parameters": len(grads),
            "eval_logits_sha256": logits_sha, **_path_taken(repack)}


# ---------------------------------------------------------------------------------------------
# Save after forward


def _safetensors_digest(folder: Path) -> Dict[str, str]:
    return {p.name: _sha256(p.read_bytes()) for p in sorted(folder.glob("*.safetensors"))}


def _save(model: Any, folder: Path) -> None:
    import inspect

    # transformers 5.x re-applies its load-time weight conversions when saving; the 4-bit
    # quantization op has no reverse (NotImplementedError in 5.24), and a 4-bit checkpoint is
    # already in the format it loads from.
    extra = {"save_original_format": False} if "save_original_format" in inspect.signature(
        model.save_pretrained).parameters else {}
    model.save_pretrained(folder, **extra)


def save_after_forward(workdir: Path) -> Dict[str, Any]:
    """A pre-quantized 4-bit checkpoint (nf4 double quant; fp4 single quant), loaded, two no_grad
    forwards, ``save_pretrained``: the safetensors files are byte-equal to the loaded checkpoint
    (sha256), every tensor too. Unpatched on a repacking CPU absmax comes back through bfloat16
    (and double quant re-quantized)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ._models import input_ids
    from ._bnb import base_checkpoint, load_quantized, quant_config

    repack = cpu_repack()
    base = base_checkpoint(workdir)
    ids = input_ids()
    files = 0
    from .bnb_quant_state_offload import quantizes_on

    for quant_type, double_quant in (("nf4", True), ("fp4", False)):
        if not quantizes_on("cpu", quant_type):  # bitsandbytes 0.46.x: nf4 only on the CPU
            continue
        quantized = workdir / f"q-{quant_type}-{double_quant}"
        _save(load_quantized(base, quant_config(quant_type, double_quant)), quantized)
        loaded = _safetensors_digest(quantized)
        model = AutoModelForCausalLM.from_pretrained(quantized, device_map={"": "cpu"}).eval()
        with torch.no_grad():
            model(ids)
            model(ids)
        saved = workdir / f"saved-{quant_type}-{double_quant}"
        _save(model, saved)
        what = f"{quant_type} double_quant={double_quant}: save_pretrained after two forwards"
        checkpoint = {k: v for f in sorted(quantized.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        _assert_same_bytes(checkpoint, {k: v for f in sorted(saved.glob("*.safetensors"))
                                        for k, v in load_file(str(f)).items()}, what)
        if _safetensors_digest(saved) != loaded:
            raise AssertionError(f"{what}: the safetensors files are not byte-equal to the loaded checkpoint")
        files += len(loaded)
    return {"max_abs_diff": 0.0, "cpu_repack": repack, "files_compared": files, **_path_taken(repack)}


# ---------------------------------------------------------------------------------------------
# Offloaded layers: every quant_storage and shape


# (quant_type, double_quant, quant_storage, compute_dtype, (in_features, out_features)): twelve
# combinations, a pairwise cover rather than the full product (CI time): every quant_storage with three
# of the four quant type / double quant pairs (both quant types), every compute dtype with every shape.
# Shapes: 64x64 (the repack block), 64->48 (out not a multiple of 32), 96->64 (in not a multiple of the
# blocksize 64).
_PAIRS = (("nf4", True), ("fp4", False), ("nf4", False), ("fp4", True))
_STORAGES = ("uint8", "bfloat16", "float16", "float32")
_COMPUTE_SHAPES = (("float32", (64, 64)), ("bfloat16", (64, 48)), ("bfloat16", (64, 64)),
                   ("float32", (96, 64)), ("float32", (64, 48)), ("bfloat16", (96, 64)))
LAYER_MATRIX = tuple((*_PAIRS[i % 4], _STORAGES[(i + i // 4) % 4], *_COMPUTE_SHAPES[i % 6]) for i in range(12))


def _layers(qt: str, dq: bool, storage: str, compute: str, shape: Tuple[int, int]) -> Any:
    import bitsandbytes as bnb
    import torch
    from torch import nn

    torch.manual_seed(0)
    fan_in, fan_out = shape
    dims = ((fan_in, fan_out), (fan_out, fan_out), (fan_out, fan_out))
    layers = [bnb.nn.Linear4bit(i, o, compute_dtype=getattr(torch, compute), compress_statistics=dq,
                                quant_type=qt, quant_storage=getattr(torch, storage), bias=False) for i, o in dims]
    return nn.Sequential(*layers).to("cpu").eval()  # quantizes on the CPU


@contextlib.contextmanager
def _counting_repacks() -> Iterator[List[int]]:
    """Counts bitsandbytes' CPU repacks (module and functional references alike)."""
    import bitsandbytes.functional as F
    import bitsandbytes.nn.modules as M

    original = getattr(F, "_convert_weight_packed_for_cpu", None)
    count = [0]
    if original is None:  # a release without the CPU repack
        yield count
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    had_module_name = hasattr(M, "_convert_weight_packed_for_cpu")
    F._convert_weight_packed_for_cpu = counted
    if had_module_name:
        M._convert_weight_packed_for_cpu = counted
    try:
        yield count
    finally:
        F._convert_weight_packed_for_cpu = original
        if had_module_name:
            M._convert_weight_packed_for_cpu = original


def _forward_drift(loaded: Dict[str, Any], after: Dict[str, Any], what: str) -> int:
    """What the in-memory layers' forwards changed in their state dict: nothing, except that
    bitsandbytes 0.49.x's ``matmul_4bit`` records the input dtype as ``quant_state.dtype`` at
    each forward of a layer on the portable kernel (metadata in the packed quant state only;
    0.50 no longer does). Returns how many quant states that rewrote; anything else raises."""
    import bitsandbytes

    from .bnb_quant_state_offload import _unpacked_blob

    want, got = _digest(loaded), _digest(after)
    changed = sorted(k for k in want if want[k] != got.get(k))
    if not changed:
        return 0
    rewritten = [k for k in changed if ".quant_state.bitsandbytes__" in k
                 and {f: v for f, v in _unpacked_blob(after[k]).items() if f != "dtype"}
                 == {f: v for f, v in _unpacked_blob(loaded[k]).items() if f != "dtype"}]
    if bitsandbytes.__version__.startswith("0.49.") and rewritten == changed:
        return len(rewritten)
    raise AssertionError(f"{what}: the in-memory layers' forwards changed their state dict: {changed[:3]}")


def offloaded_layer_matrix(workdir: Path) -> Dict[str, Any]:
    """Three Linear4bit layers per combination of LAYER_MATRIX, the last two offloaded (disk via
    ``dispatch_model``, and cpu via ``accelerate.cpu_offload``): two no_grad forwards equal the
    in-memory layers (the second, for cpu offload, without repacking: ``repacks_at_second_forward``), and the
    offloaded model's state dict (``get_state_dict_offloaded_model``)
    is byte-equal to the in-memory one, which is what was quantized (see _forward_drift)."""
    import copy

    import accelerate
    import torch
    from accelerate.utils.modeling import get_state_dict_offloaded_model

    import bitsandbytes.functional

    from . import NotApplicable
    from .bnb_quant_state_offload import quantizes_on

    if not hasattr(bitsandbytes.functional, "_convert_weight_packed_for_cpu"):
        # bitsandbytes < 0.49 has no CPU repack, and its CPU kernels take only uint8 storage (in memory
        # too): the offload bugs of those releases are bnb-quant-state-offload's scenarios.
        raise NotApplicable("needs bitsandbytes >= 0.49 (CPU weight repacking)")
    repack = cpu_repack()
    failures: List[str] = []
    ran = drifted = repacked_again = 0
    for combo in LAYER_MATRIX:
        qt, dq, storage, compute, shape = combo
        if not quantizes_on("cpu", qt):
            continue
        tag = f"{qt}/dq={dq}/{storage}/{compute}/{shape[0]}x{shape[1]}"
        for offload in ("disk", "cpu"):
            reference = _layers(*combo)
            loaded = {k: v.clone() for k, v in reference.state_dict().items()}
            model = copy.deepcopy(reference)
            x = torch.randn(2, shape[0], generator=torch.Generator().manual_seed(1))
            try:
                with torch.no_grad():
                    expected = reference(x)
                    if offload == "disk":
                        accelerate.dispatch_model(model, {"0": "cpu", "1": "disk", "2": "disk"},
                                                  offload_dir=str(workdir / f"offload-{ran}"))
                    else:
                        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
                    outputs = [model(x)]
                    with _counting_repacks() as repacks:
                        outputs.append(model(x))
                    if offload == "cpu":  # a disk-offloaded weight is repacked at every forward (nothing cached)
                        repacked_again += repacks[0]
                if not all(torch.equal(out, expected) for out in outputs):
                    failures.append(f"{tag} {offload}: output differs from the in-memory layers")
                    continue
                after = {k: v.clone() for k, v in reference.state_dict().items()}
                _assert_same_bytes(after, get_state_dict_offloaded_model(model), f"{tag} {offload}: state dict")
                drifted += _forward_drift(loaded, after, f"{tag} {offload}")
            except Exception as exc:  # collected: one combination must not hide the others
                failures.append(f"{tag} {offload}: {type(exc).__name__}: {str(exc)[:120]}")
            ran += 1
    if failures:
        raise AssertionError(f"{len(failures)} of {ran} offloaded 4-bit cases fail: " + "; ".join(failures[:4]))
    return {"max_abs_diff": 0.0, "cpu_repack": repack, "cases": ran,
            "quant_state_dtype_rewritten_by_forward": drifted, "repacks_at_second_forward": repacked_again}


def _tiny_gemma4(workdir: Path) -> Path:
    import torch

    from .gemma4_offloaded_embeddings import _require, tiny_text_config

    path = workdir / "gemma4"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        _require("Gemma4ForCausalLM")(tiny_text_config()).save_pretrained(path)
    return path


def _dispatched_model_case(workdir: Path, arch: str, path: Path, storage: str) -> int:
    """One model: in memory vs dispatched (decoder layers 1.. on disk) vs PEFT over each."""
    import accelerate
    import torch
    from accelerate.utils.modeling import get_state_dict_offloaded_model
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ._models import input_ids
    from ._bnb import _require_bitsandbytes

    _require_bitsandbytes()
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=getattr(torch, storage))

    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map={"": "cpu"}).eval()

    reference = load()
    loaded = {k: v.clone() for k, v in reference.state_dict().items()}
    inner = reference.model
    device_map = {f"model.{name}": "cpu" for name, _ in inner.named_children() if name != "layers"}
    device_map["lm_head"] = "cpu"
    device_map.update({f"model.layers.{i}": "disk" if i else "cpu" for i in range(len(inner.layers))})
    model = accelerate.dispatch_model(load(), device_map=device_map, main_device="cpu",
                                      offload_dir=str(workdir / f"offload-{arch}"))
    ids = input_ids()
    what = f"{arch} nf4 double quant, quant_storage={storage}"
    with torch.no_grad():
        expected = reference(ids).logits
        if not all(torch.equal(model(ids).logits, expected) for _ in range(2)):
            raise AssertionError(f"{what}: the dispatched model's logits differ from the in-memory model")
    after = {k: v.clone() for k, v in reference.state_dict().items()}
    _assert_same_bytes(after, get_state_dict_offloaded_model(model), f"{what}: dispatched state dict")
    _forward_drift(loaded, after, what)
    torch.manual_seed(3)
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                                        init_lora_weights=False))
    adapter.save_pretrained(workdir / f"lora-{arch}")
    with torch.no_grad():
        expected = PeftModel.from_pretrained(reference, workdir / f"lora-{arch}").eval()(ids).logits
        peft_model = PeftModel.from_pretrained(model, workdir / f"lora-{arch}").eval()
        if not all(torch.equal(peft_model(ids).logits, expected) for _ in range(2)):
            raise AssertionError(f"{what}: PeftModel over the dispatched model differs from the in-memory one")
    return 1


def dispatched_models(workdir: Path) -> Dict[str, Any]:
    """Real models through ``dispatch_model`` (decoder layers on disk) and ``PeftModel.from_pretrained``
    over them: a tiny Llama with ``bnb_4bit_quant_storage=bfloat16`` (FSDP/QLoRA recipes) and a tiny
    Gemma4ForCausalLM (nf4 double quant; its per-layer projections are not a multiple of the repack
    block). Logits equal to the in-memory model, the dispatched state dict byte-equal to it."""
    import bitsandbytes.functional

    from . import NotApplicable
    from ._bnb import base_checkpoint

    if not hasattr(bitsandbytes.functional, "_convert_weight_packed_for_cpu"):
        # as in the layer matrix: bitsandbytes < 0.49 has no CPU repack, and its CPU kernels take only uint8
        # storage (the in-memory Llama with bfloat16 storage fails too); its offload bugs are bnb-quant-state-offload's
        raise NotApplicable("needs bitsandbytes >= 0.49 (CPU weight repacking)")
    repack = cpu_repack()
    metrics: Dict[str, Any] = {"max_abs_diff": 0.0, "cpu_repack": repack}
    metrics["llama_bfloat16_storage"] = _dispatched_model_case(workdir, "llama", base_checkpoint(workdir), "bfloat16")
    try:
        gemma = _tiny_gemma4(workdir)
    except NotApplicable as exc:  # said in the result, not skipped silently
        metrics["gemma4_uint8_storage"] = f"n/a: {exc}"
    else:
        metrics["gemma4_uint8_storage"] = _dispatched_model_case(workdir, "gemma4", gemma, "uint8")
    return metrics


_HERE = __name__
SCENARIOS = [
    Scenario(PATCH_ID, "training-after-eval", f"{_HERE}:training_after_eval",
             "QLoRA after one no_grad evaluation: the repacked 4-bit layers have no backward, LoRA "
             "parameters get grad None (CPUs with AVX512-BF16)",
             expected_error="AssertionError", **_CPU_LIBRARY),
    Scenario(PATCH_ID, "save-after-forward", f"{_HERE}:save_after_forward",
             "save_pretrained of a 4-bit checkpoint after forwards writes what was loaded (sha256 of the "
             "files); upstream converts the repacked state back lossily",
             expected_error="AssertionError", **_CPU_LIBRARY),
    Scenario(PATCH_ID, "offloaded-layer-matrix", f"{_HERE}:offloaded_layer_matrix",
             "Linear4bit layers offloaded to disk/cpu for nf4/fp4, double quant on/off, every "
             "quant_storage, fp32/bf16 compute and shapes off the repack block: equal to in memory, "
             "state dict byte-equal",
             expected_error="AssertionError", **_CPU_LIBRARY),
    Scenario(PATCH_ID, "dispatched-models", f"{_HERE}:dispatched_models",
             "a tiny Llama (quant_storage=bfloat16) and Gemma 4 (nf4 double quant) dispatched with disk "
             "layers, and PeftModel.from_pretrained over them: equal to in memory, state dict byte-equal",
             expected_error="RuntimeError", in_selftest=False, **_CPU_LIBRARY),
]
