"""Two-rank reproducer for ``accelerate-fsdp2-adapter-state`` (gloo on CPU): a LoRA adapter saved
and reloaded through accelerate's FSDP2 ``FULL_STATE_DICT`` path, compared on every rank, and in the
file written, with the single-process model built from the same checkpoint and seed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from ._fsdp import lora_model
from ._harness import Scenario
from ._models import input_ids, max_abs_diff, save_tiny_llama
from ._ranks import FSDP2_ON_CPU, GLOO_RANKS, FSDP_ENV, fsdp_accelerator, raise_first_error, run_ranks

ADAPTER_STATE = "accelerate-fsdp2-adapter-state"
_SAVED = "pytorch_model_fsdp.bin"  # accelerate's FSDP_MODEL_NAME, model_index 0


def _full(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


# -- save_fsdp_model / load_fsdp_model(adapter_only=True), FSDP2 FULL_STATE_DICT -------------------

def _adapter_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    import torch
    from accelerate.utils import load_fsdp_model, save_fsdp_model

    os.environ.update(FSDP_ENV)
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"  # every rank builds the adapter itself
    accelerator = fsdp_accelerator()
    model = lora_model(workdir / "ckpt")
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    plugin = accelerator.state.fsdp_plugin
    save_fsdp_model(plugin, accelerator, model, str(workdir / "saved"), adapter_only=True)
    accelerator.wait_for_everyone()
    with torch.no_grad():  # a shard the load does not restore must show, not keep its old value
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.zero_()
    load_fsdp_model(plugin, accelerator, model, str(workdir / "saved"), adapter_only=True)
    adapter = {name: _full(p) for name, p in model.named_parameters() if "lora_" in name}
    with torch.no_grad():
        logits = model(input_ids=input_ids()).logits
    return {"adapter": adapter, "logits": logits}


def _check_file(path: Path, *layouts: Dict[str, Any]) -> Dict[str, Any]:
    """The saved adapter equals one of ``layouts`` (peft's key names: accelerate <= 1.14; the model's
    own names of its trainable parameters: 1.15) tensor by tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    saved = torch.load(path, weights_only=False)
    expected = next((layout for layout in layouts if set(layout) == set(saved)), None)
    if expected is None:
        raise AssertionError(f"the saved adapter's keys are none of one process's layouts: {sorted(saved)[:3]}")
    for key, value in expected.items():
        got = saved[key]
        if isinstance(got, DTensor):  # pickled DTensor: only the writing rank's local shard is in the file
            raise AssertionError(f"the saved adapter holds rank 0's shard only: {key} is a DTensor of global shape "
                                 f"{tuple(got.shape)} with a local {tuple(got.to_local().shape)} tensor")
        if got.shape != value.shape or not torch.equal(got, value):
            raise AssertionError(f"the saved adapter differs from one process's at {key}: shape {tuple(got.shape)} "
                                 f"vs {tuple(value.shape)}")
    return {"saved_tensors": len(saved)}


def adapter_save_reload(workdir: Path) -> Dict[str, Any]:
    """A LoRA model (r=4, non-zero) prepared with FSDP2 on two ranks, saved with
    ``save_fsdp_model(adapter_only=True)`` (FULL_STATE_DICT, what Trainer does), zeroed and loaded back
    with ``load_fsdp_model``: the file equals the single-process adapter tensor by tensor, and every
    rank's reloaded adapter and logits equal one process's."""
    import torch
    from peft import get_peft_model_state_dict

    save_tiny_llama(workdir / "ckpt")
    reference = lora_model(workdir / "ckpt").eval()
    expected_file = {k: v.detach().clone() for k, v in get_peft_model_state_dict(reference).items()}
    adapter = {name: p.detach().clone() for name, p in reference.named_parameters() if "lora_" in name}
    trainable = {name: p.detach().clone() for name, p in reference.named_parameters() if p.requires_grad}
    with torch.no_grad():
        logits = reference(input_ids=input_ids()).logits
    reports = run_ranks(f"{__name__}:_adapter_rank", workdir)
    if (workdir / "saved" / _SAVED).exists():  # the file is judged first: it is what a resume reads
        metrics = _check_file(workdir / "saved" / _SAVED, expected_file, trainable)
    else:
        metrics = {}
    raise_first_error(reports)
    for report in reports:
        got = report["result"]
        diff = max(max_abs_diff(got["adapter"][name], value) for name, value in adapter.items())
        metrics[f"rank{report['rank']}_adapter_diff"] = diff
        metrics[f"rank{report['rank']}_logits_diff"] = max_abs_diff(got["logits"], logits)
    metrics["max_abs_diff"] = max(v for k, v in metrics.items() if k.endswith("_diff"))
    if metrics["max_abs_diff"] > 0:
        raise AssertionError(f"a rank's reloaded adapter differs from one process's: {metrics}")
    return metrics


SCENARIOS = [
    Scenario(ADAPTER_STATE, "adapter-save-reload", f"{__name__}:adapter_save_reload",
             "LoRA over FSDP2 on two ranks (gloo), save_fsdp_model/load_fsdp_model(adapter_only=True) with "
             "FULL_STATE_DICT: the file and every rank's reloaded adapter equal one process's",
             expected_error="AssertionError", expected_message="the saved adapter holds rank 0's shard only",
             # two-rank FSDP loading was measured from these releases on (other code variants below them)
             requires={"accelerate": ">=1.13", "transformers": ">=5.7", "peft": ">=0.17", **FSDP2_ON_CPU},
             **GLOO_RANKS),
]
