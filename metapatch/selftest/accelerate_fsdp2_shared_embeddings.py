"""Two-rank reproducers for tied embeddings through accelerate's FSDP2 prepare (gloo on CPU): a
causal LM whose ``lm_head`` is its input embedding, and BART, whose ``shared`` embedding is also the
encoder's and the decoder's ``embed_tokens`` and the ``lm_head``. Logits after prepare and after one
SGD step on every rank are compared with one process's. T5 (the same tie) loaded in float16 and bfloat16
through the same prepare is declared here too; its code is in ``_fsdp_loading_flows.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Tuple

from ._fsdp_loading_flows import __name__ as _FLOWS_MODULE
from ._harness import Expect, Scenario
from ._models import input_ids, max_abs_diff, save_tiny_llama
from ._ranks import (FSDP2_ON_CPU, FSDP2_TRAINING_ON_CPU, GLOO_RANKS, FSDP_ENV, fsdp_accelerator, raise_first_error,
                     run_ranks)

SHARED_EMBEDDINGS = "accelerate-fsdp2-shared-embeddings"
_STEP_TOLERANCE = 1e-5  # FSDP2 averages the two ranks' gradients: a different summation order


def _save_tiny_bart(path: Path) -> None:
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    BartForConditionalGeneration(config).save_pretrained(path)


def _load(kind: str, path: Path) -> Any:
    from transformers import AutoModelForCausalLM, BartForConditionalGeneration

    return (BartForConditionalGeneration if kind == "bart" else AutoModelForCausalLM).from_pretrained(path)


def _batch(kind: str) -> Dict[str, Any]:
    ids = input_ids()
    batch = {"input_ids": ids, "labels": ids}
    if kind == "bart":
        batch["decoder_input_ids"] = input_ids(seed=2)
    return batch


def _forward_and_step(model: Any, optimizer: Any, kind: str, backward: Any) -> Tuple[Any, Any]:
    import torch

    batch = _batch(kind)
    with torch.no_grad():
        before = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    backward(model(**batch).loss)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return before, after


def _tied_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    import torch

    os.environ.update(FSDP_ENV)
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"  # the ties alone, not the broadcast path
    kind = (workdir / "kind").read_text()
    accelerator = fsdp_accelerator()
    model = _load(kind, workdir / "ckpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    before, after = _forward_and_step(model, optimizer, kind, accelerator.backward)
    return {"before": before, "after": after}


def _tied(workdir: Path, kind: str) -> Dict[str, Any]:
    import torch

    (workdir / "kind").write_text(kind)
    if kind == "bart":
        _save_tiny_bart(workdir / "ckpt")
    else:
        save_tiny_llama(workdir / "ckpt", tie_word_embeddings=True)
    model = _load(kind, workdir / "ckpt")
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    if not tied:
        raise AssertionError("the reference model is not tied: the scenario would prove nothing")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before, after = _forward_and_step(model, optimizer, kind, lambda loss: loss.backward())
    reports = run_ranks(f"{__name__}:_tied_rank", workdir)
    raise_first_error(reports)
    metrics: Dict[str, Any] = {"step_change": max_abs_diff(after, before)}
    for report in reports:
        metrics[f"rank{report['rank']}_before_diff"] = max_abs_diff(report["result"]["before"], before)
        metrics[f"rank{report['rank']}_after_diff"] = max_abs_diff(report["result"]["after"], after)
    metrics["max_abs_diff"] = max(v for k, v in metrics.items() if k.endswith("_diff"))
    if not metrics["step_change"] > 0 or metrics["max_abs_diff"] > _STEP_TOLERANCE:
        raise AssertionError(f"a rank differs from the single-process step: {metrics}")
    return metrics


def tied_causal_lm(workdir: Path) -> Dict[str, Any]:
    """A Llama with ``tie_word_embeddings=True`` through accelerator.prepare with FSDP2, one SGD step:
    every rank's logits before and after the step equal one process's."""
    return _tied(workdir, "llama")


def bart_three_way_tie(workdir: Path) -> Dict[str, Any]:
    """BART (``shared`` = encoder and decoder ``embed_tokens`` = ``lm_head``) through
    accelerator.prepare with FSDP2, one SGD step: every rank equals one process."""
    return _tied(workdir, "bart")


_SHARED = "is shared with a parameter already managed by another FSDP group"  # FSDP2's own check, torch >= 2.13
_WRONG_STEP = "a rank differs from the single-process step"  # torch <= 2.12 has no such check
# Measured on torch 2.11.0 (accelerate 1.14.0 and 1.16.0): both ranks' logits after the step 3.98 (BART)
# off one process's; the tied Llama on 1.14.0 likewise. 1.15 groups a causal LM's tied pair itself.
_SILENT_BEFORE_TORCH_2_13 = Expect("AssertionError", _WRONG_STEP, when={"torch": "<2.13"})

SCENARIOS = [
    Scenario(SHARED_EMBEDDINGS, "tied-causal-lm", f"{__name__}:tied_causal_lm",
             "a tied Llama through accelerator.prepare with FSDP2 (two ranks, gloo), one SGD step: every rank equals "
             "one process (accelerate 1.14: 'shared with a parameter already managed by another FSDP group' with torch "
             "2.13, a wrong step on every rank with older torch)",
             expected_error="ValueError", expected_message=_SHARED, tolerance=_STEP_TOLERANCE,
             # accelerate 1.15 groups the input and output embeddings itself (huggingface/accelerate#4171)
             unpatched=(Expect("", when={"accelerate": ">=1.15"}), _SILENT_BEFORE_TORCH_2_13),
             # two-rank FSDP loading was measured from these releases on (other code variants below them)
             requires={"accelerate": ">=1.13", "transformers": ">=5.7", **FSDP2_TRAINING_ON_CPU},
             **GLOO_RANKS),
    Scenario(SHARED_EMBEDDINGS, "bart-three-way-tie", f"{__name__}:bart_three_way_tie",
             "BART's shared/encoder/decoder embed_tokens/lm_head tie through accelerator.prepare with FSDP2 (two ranks, "
             "gloo), one SGD step: every rank equals one process (torch 2.13: 'shared with a parameter already managed "
             "by another FSDP group'; older torch: a wrong step on every rank)",
             expected_error="ValueError", expected_message=_SHARED, tolerance=_STEP_TOLERANCE, quick=True,
             unpatched=(_SILENT_BEFORE_TORCH_2_13,),
             # two-rank FSDP loading was measured from these releases on (other code variants below them)
             requires={"accelerate": ">=1.13", "transformers": ">=5.7", **FSDP2_TRAINING_ON_CPU},
             **GLOO_RANKS),
    Scenario(SHARED_EMBEDDINGS, "t5-half-precision-prepare", f"{_FLOWS_MODULE}:half_precision_train_ranks",
             "T5 (shared/encoder/decoder embed_tokens/lm_head tie) loaded in bfloat16 and in float16 (wo kept in "
             "float32) through accelerator.prepare with FSDP2 cpu_ram_efficient_loading (two ranks, gloo): bfloat16 "
             "equals one process on every rank; float16 is refused by FSDP2 itself at the first forward (two dtypes "
             "in one group), with and without metapatch",
             expected_error="ValueError", expected_message=_SHARED, in_selftest=False,
             # it prepares and runs a forward, no step: only torch 2.13's check shows the doubly grouped tie
             unpatched=(Expect("", when={"torch": "<2.13"}),),
             requires={"accelerate": ">=1.13", "transformers": ">=5.7", **FSDP2_ON_CPU}, **GLOO_RANKS),
]
