"""Two-rank reproducers for ``fsdp-rank-placeholders`` (accelerate FSDP2 with
``cpu_ram_efficient_loading``, gloo on CPU): a sequence-classification model whose new ``score``
head only rank 0 initialises, prepared for evaluation and for training; every rank is compared with
the single-process in-memory reference. The loading flows of the offload patches (a head re-initialised at
load, T5 in float16 with a float32 ``wo`` and in bfloat16) are declared here too; their code is in
``_fsdp_loading_flows.py``.

Each scenario builds a tiny checkpoint, computes the reference in this process (no process group),
then runs the flow as two ranks with :func:`metapatch.selftest._ranks.run_ranks` and raises when a
rank fails or differs. ``metrics`` has one ``max_abs_diff`` per rank and the overall maximum.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from ._fsdp import compare_ranks
from ._fsdp_loading_flows import __name__ as _FLOWS_MODULE
from ._harness import Scenario
from ._models import input_ids, max_abs_diff, save_tiny_llama
from ._ranks import GLOO_RANKS, FSDP_ENV, fsdp_accelerator, raise_first_error, run_ranks

PLACEHOLDERS = "fsdp-rank-placeholders"
_LABELS = 3
_SEED = 0
_STEP_TOLERANCE = 1e-5  # FSDP2 averages the two ranks' gradients: a different summation order


def _seq_cls(path: Path) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(_SEED)  # the new score head is drawn from the same generator state everywhere
    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=_LABELS)


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

    save_tiny_llama(workdir / "ckpt", pad_token_id=0)
    with torch.no_grad():
        logits = _seq_cls(workdir / "ckpt").eval()(input_ids=input_ids()).logits
    reports = run_ranks(f"{__name__}:_eval_rank", workdir)
    raise_first_error(reports)
    # Before prepare, only rank 0 loaded: reported (right, refused or wrong) for the tests to judge;
    # the upstream diff fixes the prepared model, not this early use.
    early = {f"rank{r['rank']}_early": "refused" if r["result"]["early"] is None else
             ("equal" if max_abs_diff(r["result"]["early"], logits) == 0 else "differs") for r in reports}
    metrics = compare_ranks(reports, {"logits": logits})
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
    metrics = compare_ranks(run_ranks(f"{__name__}:_train_rank", workdir),
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


SCENARIOS = [
    Scenario(PLACEHOLDERS, "eval-only-new-head", f"{__name__}:eval_only_new_head",
             "AutoModelForSequenceClassification over a causal-LM checkpoint under FSDP cpu_ram_efficient_loading, "
             "prepare_model(evaluation_mode=True): every rank's logits equal one process's (two ranks, gloo)",
             expected_error="AssertionError", expected_message=r"'rank0_logits_diff': 0\.0",
             # two-rank FSDP loading was measured from these releases on (other code variants below them)
             requires={"transformers": ">=5.7", "accelerate": ">=1.13"}, **GLOO_RANKS),  # rank 1 differs
    Scenario(PLACEHOLDERS, "train-step-new-head", f"{__name__}:train_step_new_head",
             "the same model through accelerator.prepare, one SGD step, full state dict saved on rank 0 and "
             "reloaded: equal to one process on every rank (must pass unpatched too)",
             in_selftest=False,
             # two-rank FSDP loading was measured from these releases on (other code variants below them)
             requires={"transformers": ">=5.7", "accelerate": ">=1.13"}, **GLOO_RANKS),
    Scenario(PLACEHOLDERS, "loading-flows-ranks", f"{_FLOWS_MODULE}:loading_flows_ranks",
             "under FSDP2 cpu_ram_efficient_loading every rank's state dict and logits equal one process's: a "
             "5-label checkpoint loaded with num_labels=2, ignore_mismatched_sizes=True (a head initialised at "
             "load, same seed) after prepare_model(evaluation_mode=True) and after prepare(model, optimizer); T5 in "
             "float16 (wo kept in float32) and in bfloat16 after prepare_model(evaluation_mode=True) (unpatched: "
             "rank 1's new head is a placeholder after the evaluation prepare; T5 is right upstream from 5.23)",
             expected_error="AssertionError", expected_message=r"rank 1 new-head after eval prepare", in_selftest=False,
             requires={"transformers": ">=5.7", "accelerate": ">=1.13"}, **GLOO_RANKS),
]
