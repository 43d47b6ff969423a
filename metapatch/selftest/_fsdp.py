"""What the two-rank FSDP reproducers share (gloo on CPU): the non-zero LoRA adapter every process builds
alike, and the per-rank comparison with the single-process reference (the releases each was measured from
are declared on its Scenario: ``requires``). Imported only inside scenario functions: torch is heavy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from ._models import max_abs_diff
from ._ranks import raise_first_error

LORA_SEED = 3


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
