"""What the two-rank FSDP reproducers share (gloo on CPU): the releases they were measured on, the
non-zero LoRA adapter every process builds alike, and the per-rank comparison with the
single-process reference. Imported only inside scenario functions: torch is heavy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from . import NotApplicable
from ._models import max_abs_diff
from ._ranks import raise_first_error

LORA_SEED = 3


def within_measured(**minimums: str) -> None:
    """Below the releases these two-rank flows were measured on, the patches claim nothing (their
    targets are other code variants, and transformers 4.57 has no such loading step): n/a, not a verdict."""
    from importlib.metadata import version

    from packaging.version import Version

    for distribution, minimum in minimums.items():
        if Version(version(distribution)) < Version(minimum):
            raise NotApplicable(f"two-rank FSDP loading measured from {distribution} {minimum} on "
                                f"({version(distribution)} installed)")


def lora_model(path: Path) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(LORA_SEED)  # the same non-zero adapter in every process
    # r=4 over two ranks: each rank holds a (2, 64) shard of every lora_A
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def compare_ranks(reports: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float = 0.0) -> Dict[str, Any]:
    raise_first_error(reports)
    metrics: Dict[str, Any] = {}
    for report in reports:
        for key, expected in reference.items():
            got = report["result"][key]
            if got is None:  # refused with MetapatchError: allowed, and counted
                metrics[f"rank{report['rank']}_{key}_refused"] = 1
                continue
            metrics[f"rank{report['rank']}_{key}_diff"] = max_abs_diff(got, expected)
    metrics["max_abs_diff"] = max(v for k, v in metrics.items() if k.endswith("_diff"))
    if metrics["max_abs_diff"] > tolerance:
        raise AssertionError(f"a rank differs from the single-process reference: {metrics}")
    return metrics
