"""Two-rank reproducers for FSDP loading (accelerate FSDP2 with ``cpu_ram_efficient_loading``, gloo
on CPU): every rank is compared with the single-process in-memory reference.

Each scenario builds a tiny checkpoint, computes the reference in this process (no process group),
then runs the flow as two ranks with :func:`metapatch.selftest._ranks.run_ranks` and raises when a
rank fails or differs. ``metrics`` has one ``max_abs_diff`` per rank and the overall maximum.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List

from . import NotApplicable
from ._harness import Scenario
from ._models import input_ids, max_abs_diff, save_tiny_llama
from ._ranks import FSDP_ENV, fsdp_accelerator, raise_first_error, run_ranks

PLACEHOLDERS = "fsdp-rank-placeholders"
PLAIN_BUFFERS = "accelerate-fsdp2-plain-buffers"
_LABELS = 3
_SEED = 0
_STEP_TOLERANCE = 1e-5  # FSDP2 averages the two ranks' gradients: a different summation order
_TIMEOUT = 150


def _within_measured(**minimums: str) -> None:
    """Below the releases these two-rank flows were measured on, the patches claim nothing (their
    targets are other code variants, and transformers 4.57 has no such loading step): n/a, not a verdict."""
    from importlib.metadata import version

    from packaging.version import Version

    for distribution, minimum in minimums.items():
        if Version(version(distribution)) < Version(minimum):
            raise NotApplicable(f"two-rank FSDP loading measured from {distribution} {minimum} on "
                                f"({version(distribution)} installed)")


def _seq_cls(path: Path) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(_SEED)  # the new score head is drawn from the same generator state everywhere
    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=_LABELS)


def _compare(reports: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float = 0.0) -> Dict[str, Any]:
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


# -- evaluation only: accelerator.prepare_model(model, evaluation_mode=True) ----------------------

def _eval_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    import torch

    from metapatch import MetapatchError

    os.environ.update(FSDP_ENV)
    accelerator = fsdp_accelerator()
    model = _seq_cls(workdir / "ckpt").eval()
    with torch.no_grad():
        try:  # used before any prepare: rank 0's model, or a refusal, never a third answer
            early = model(input_ids=input_ids()).logits
        except MetapatchError:
            early = None
        model = accelerator.prepare_model(model, evaluation_mode=True)
        return {"logits": model(input_ids=input_ids()).logits, "early": early}


def eval_only_new_head(workdir: Path) -> Dict[str, Any]:
    """A sequence-classification model over a causal-LM checkpoint (a new ``score`` head), loaded
    under FSDP cpu_ram_efficient_loading and prepared for evaluation only: every rank's logits must be
    the single-process model's. A forward before prepare is reported per rank in ``rankN_early``."""
    import torch

    _within_measured(transformers="5.7", accelerate="1.13")
    save_tiny_llama(workdir / "ckpt", pad_token_id=0)
    with torch.no_grad():
        logits = _seq_cls(workdir / "ckpt").eval()(input_ids=input_ids()).logits
    reports = run_ranks(f"{__name__}:_eval_rank", workdir, timeout=_TIMEOUT)
    raise_first_error(reports)
    # Before prepare, only rank 0 loaded: reported (right, refused or wrong) for the tests to judge;
    # the upstream diff fixes the prepared model, not this early use.
    early = {f"rank{r['rank']}_early": "refused" if r["result"]["early"] is None else
             ("equal" if max_abs_diff(r["result"]["early"], logits) == 0 else "differs") for r in reports}
    metrics = _compare(reports, {"logits": logits})
    metrics.update(early)
    return metrics


# -- training: accelerator.prepare(model, optimizer), one step, full state dict saved and reloaded --

def _step(model: Any, optimizer: Any, backward: Any) -> Any:
    import torch

    ids = input_ids()
    loss = model(input_ids=ids, labels=torch.tensor([1])).loss
    backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def _train_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    import torch

    os.environ.update(FSDP_ENV)
    accelerator = fsdp_accelerator()
    model = _seq_cls(workdir / "ckpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    with torch.no_grad():
        before = model(input_ids=input_ids()).logits
    _step(model, optimizer, accelerator.backward)
    with torch.no_grad():
        after = model(input_ids=input_ids()).logits
    state = accelerator.get_state_dict(model)  # a collective: every rank takes part
    if rank == 0:
        accelerator.unwrap_model(model).save_pretrained(workdir / "saved", state_dict=state)
    return {"before": before, "after": after}


def train_step_new_head(workdir: Path) -> Dict[str, Any]:
    """The same model prepared for training: logits after prepare and after one SGD step on every
    rank, and the checkpoint rank 0 saves, reloaded in one process, equal the single-process run."""
    import torch

    _within_measured(transformers="5.7", accelerate="1.13")
    save_tiny_llama(workdir / "ckpt", pad_token_id=0)
    model = _seq_cls(workdir / "ckpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.no_grad():
        before = model(input_ids=input_ids()).logits
    _step(model, optimizer, lambda loss: loss.backward())
    with torch.no_grad():
        after = model(input_ids=input_ids()).logits
    step_change = max_abs_diff(after, before)
    if not step_change > 0:
        raise AssertionError("the optimizer step did not change the logits: the comparison would prove nothing")
    metrics = _compare(run_ranks(f"{__name__}:_train_rank", workdir, timeout=_TIMEOUT),
                       {"before": before, "after": after}, _STEP_TOLERANCE)
    metrics["step_change"] = step_change
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(workdir / "saved").eval()
    with torch.no_grad():
        metrics["reloaded_diff"] = max_abs_diff(reloaded(input_ids=input_ids()).logits, after)
    metrics["max_abs_diff"] = max(metrics["max_abs_diff"], metrics["reloaded_diff"])
    if metrics["reloaded_diff"] > _STEP_TOLERANCE:
        raise AssertionError(f"the saved checkpoint differs from the single-process step: {metrics}")
    return metrics


# -- a persistent buffer that is not a parameter (an MoE gate's e_score_correction_bias) -------------

def _save_tiny_moe(path: Path) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(_SEED)
    # Untied: BART's three-way embedding tie fails FSDP2's duplicate-parameter check on its own
    # (accelerate 1.15, torch 2.13), which would hide what this scenario measures.
    config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                              n_group=1, topk_group=1, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4,
                              q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              max_position_embeddings=64, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_()  # zeros at init: a lost buffer would not show
    model.save_pretrained(path)


def _moe_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.update(FSDP_ENV)
    accelerator = fsdp_accelerator()
    model = AutoModelForCausalLM.from_pretrained(workdir / "ckpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.eval()
    with torch.no_grad():
        return {"logits": model(input_ids=input_ids()).logits}


def persistent_buffer_prepare(workdir: Path) -> Dict[str, Any]:
    """A DeepSeek-V3-style MoE (persistent ``e_score_correction_bias``, not a parameter) through
    accelerator.prepare under FSDP2 cpu_ram_efficient_loading: every rank's logits equal one process's."""
    import torch
    from transformers import AutoModelForCausalLM

    _within_measured(accelerate="1.13")
    _save_tiny_moe(workdir / "ckpt")
    with torch.no_grad():
        reference = {"logits": AutoModelForCausalLM.from_pretrained(workdir / "ckpt").eval()(input_ids=input_ids()).logits}
    return _compare(run_ranks(f"{__name__}:_moe_rank", workdir, timeout=_TIMEOUT), reference, _STEP_TOLERANCE)


SCENARIOS = [
    Scenario(PLAIN_BUFFERS, "persistent-buffer-prepare", f"{__name__}:persistent_buffer_prepare",
             "a DeepSeek-V3-style MoE gate's persistent e_score_correction_bias through accelerator.prepare with FSDP2 cpu_ram_efficient_loading "
             "(two ranks, gloo): every rank's logits equal one process's",
             expected_error="AttributeError"),
    Scenario(PLACEHOLDERS, "eval-only-new-head", f"{__name__}:eval_only_new_head",
             "AutoModelForSequenceClassification over a causal-LM checkpoint under FSDP cpu_ram_efficient_loading, "
             "prepare_model(evaluation_mode=True): every rank's logits equal one process's (two ranks, gloo)",
             expected_error="AssertionError"),
    Scenario(PLACEHOLDERS, "train-step-new-head", f"{__name__}:train_step_new_head",
             "the same model through accelerator.prepare, one SGD step, full state dict saved on rank 0 and "
             "reloaded: equal to one process on every rank (must pass unpatched too)",
             in_selftest=False),
]
