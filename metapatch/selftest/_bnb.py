"""Building blocks of the bitsandbytes 4-bit scenarios (bnb-quant-state-offload, its companion
accelerate-emptiness-probe, bnb-params4bit-extra-attributes): a tiny random Llama quantized in memory on
the execution device (``_device``: GPU 0 where there is one, else the CPU), dispatched by accelerate
with two decoder layers on ``disk`` and the rest on that device (with a GPU main device, ``cpu`` entries
are offloaded the same way), and the comparisons with the undispatched model."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from . import NotApplicable

OFFLOADED_LAYERS = (1, 2)
NUM_LAYERS = 4


# ---------------------------------------------------------------------------------------------
# Building blocks


def base_checkpoint(workdir: Path) -> Path:
    from ._models import save_tiny_llama

    path = workdir / "base"
    if not (path / "config.json").exists():
        save_tiny_llama(path, num_hidden_layers=NUM_LAYERS)
    return path


def _require_bitsandbytes() -> None:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:  # a PEFT scenario on 4-bit, on a stack without it
        raise NotApplicable("needs bitsandbytes (not installed)")


def quant_config(quant_type: str = "nf4", double_quant: bool = True, compute_dtype: str = "float32") -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    # transformers 4.57's BitsAndBytesConfig reads bitsandbytes' version: PackageNotFoundError without it
    _require_bitsandbytes()
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                              bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, compute_dtype))


def load_quantized(path: Path, config: Any, device: Any = None) -> Any:
    """Quantized in memory on ``device`` (default: the execution device; reference and dispatched model
    alike, so both hold the very same packed weights)."""
    from transformers import AutoModelForCausalLM

    from ._device import main_device

    _require_bitsandbytes()
    if device is None:
        device = main_device()
    try:
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map={"": device}).eval()
    except ImportError as exc:
        # transformers 5.x refuses bitsandbytes 0.46.0 for 4-bit ("requires bitsandbytes>=0.46.1"):
        # a combination that cannot load a 4-bit model at all, not the bug under test.
        if "quantization requires bitsandbytes" not in str(exc):
            raise
        import bitsandbytes
        import transformers

        raise NotApplicable(f"transformers {transformers.__version__} does not load 4-bit models with "
                            f"bitsandbytes {bitsandbytes.__version__}: {exc}") from exc


def offload_map(offload_to: str, rest: Any = "cpu") -> Dict[str, Any]:
    device_map: Dict[str, Any] = {"model.embed_tokens": rest, "model.norm": rest, "model.rotary_emb": rest,
                                  "lm_head": rest}
    for i in range(NUM_LAYERS):
        device_map[f"model.layers.{i}"] = offload_to if i in OFFLOADED_LAYERS else rest
    return device_map


def dispatch(model: Any, workdir: Path, offload_to: str = "disk", main_device: Any = None) -> Any:
    """``model`` dispatched with OFFLOADED_LAYERS on ``offload_to``, the rest on ``main_device`` (default:
    the execution device)."""
    import accelerate

    from . import _device

    if main_device is None:
        main_device = _device.main_device()
    rest = main_device
    return accelerate.dispatch_model(model, device_map=offload_map(offload_to, rest), main_device=main_device,
                                     offload_dir=str(workdir / "offload"))


def offloaded_linears(model: Any) -> List[Tuple[str, Any]]:
    import bitsandbytes as bnb

    prefixes = tuple(f"model.layers.{i}." for i in OFFLOADED_LAYERS)
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, bnb.nn.Linear4bit) and name.startswith(prefixes)]


@contextlib.contextmanager
def counting_quantize_calls() -> Iterator[Dict[str, int]]:
    """Counts calls of bitsandbytes' quantizers (a reload must never re-quantize)."""
    import bitsandbytes.functional as F

    counts = {"quantize_4bit": 0, "quantize_blockwise": 0}
    originals = {name: getattr(F, name) for name in counts}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in counts:
        setattr(F, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(F, name, original)


def logits(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(ids.to(model.device) if hasattr(model, "device") else ids).logits.cpu()


def assert_equal_outputs(reference: Any, candidates: List[Any], what: str) -> float:
    import torch

    from ._models import max_abs_diff

    worst = 0.0
    for i, out in enumerate(candidates):
        diff = max_abs_diff(out, reference)
        worst = max(worst, diff)
        if not torch.equal(out, reference):
            raise AssertionError(f"{what}: forward #{i + 1} differs from the in-memory quantized model "
                                 f"(max abs diff {diff})")
    return worst


