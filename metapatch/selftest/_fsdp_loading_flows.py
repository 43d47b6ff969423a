"""Two-rank loading flows under accelerate FSDP2 with ``cpu_ram_efficient_loading`` (gloo on CPU), where rank
0 loads and the other ranks get rank 0's tensors at prepare: the loads that the offload patches fixed in one
process (``transformers-mismatched-disk-weights``), each compared on every rank with the single-process load.

* new heads: a 5-label ``LlamaForSequenceClassification`` checkpoint loaded through
  ``AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=2, ignore_mismatched_sizes=True)``,
  the seed set before the load: the head the load initialises anew is what every rank holds;
* half precision: T5 loaded with ``dtype=torch.float16`` (``wo``, ``_keep_in_fp32_modules``, stays float32)
  and with ``dtype=torch.bfloat16``: every rank holds the single-process load's dtypes and values.

The prepares: ``prepare_model(evaluation_mode=True)`` (``fsdp-rank-placeholders`` broadcasts rank 0's tensors
there) and ``prepare(model, optimizer)`` (accelerate's FSDP2 prepare broadcasts them). After each, every rank's
full state dict (each DTensor gathered) and logits must equal the single-process load's: the same dtypes and
exactly the same values (``max_abs_diff`` 0.0). Declared in ``fsdp_rank_placeholders.py``
(``loading-flows-ranks``) and ``accelerate_fsdp2_shared_embeddings.py`` (``t5-half-precision-prepare``: the
training prepare of T5, whose embedding tie is that patch's bug).

``rankN_<flow>_early`` reports a forward before any prepare (equal, refused with ``MetapatchError``, or how far
off), for the tests to judge: on transformers 5.11.0 rank 1's T5 (every tensor a zeros placeholder, none missing
from the checkpoint) answered 4.8 off before ``fsdp-rank-placeholders`` recorded replaced tensors too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ._models import input_ids, max_abs_diff
from ._ranks import FSDP_ENV, fsdp_accelerator, raise_first_error, run_ranks

CHECKPOINT_LABELS, NEW_LABELS = 5, 2
_SEED = 7
_DECODER_IDS = [[0, 5, 9, 17]]


# -- the loads, the same in the reference process and on every rank --------------------------------

def _save_seq_cls(path: Path) -> None:
    import torch
    from transformers import LlamaForSequenceClassification

    from ._models import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(num_labels=CHECKPOINT_LABELS, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(path)


def _load_new_head(path: Path) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(_SEED)  # the new head is drawn from the same generator state everywhere
    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=NEW_LABELS, ignore_mismatched_sizes=True)


def _save_t5(path: Path) -> None:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    T5ForConditionalGeneration(config).save_pretrained(path)


def _load_half(path: Path) -> Any:
    import torch
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float16)


def _load_bf16(path: Path) -> Any:
    import torch
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16)


# flow: (save the checkpoint, load it as each process does, the checkpoint's folder in the working directory)
_FLOWS = {"new-head": (_save_seq_cls, _load_new_head, "seq-cls"), "fp16": (_save_t5, _load_half, "t5"),
          "bf16": (_save_t5, _load_bf16, "t5")}


def _checkpoint(flow: str, workdir: Path) -> Path:
    return workdir / _FLOWS[flow][2]


def _forward(model: Any, flow: str) -> Any:
    import torch

    with torch.no_grad():
        if flow in ("fp16", "bf16"):
            return model(input_ids=input_ids(), decoder_input_ids=torch.tensor(_DECODER_IDS)).logits
        return model(input_ids=input_ids()).logits


def _full_state(model: Any) -> Dict[str, Any]:
    """Every tensor of the state dict, whole (an FSDP2 DTensor gathered: a collective), on the CPU."""
    state = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        state[name] = None if tensor.is_meta else tensor.detach().to("cpu").clone()
    return state


def _value(tensor: Any) -> Any:
    return None if tensor.is_meta else tensor


# -- every rank ------------------------------------------------------------------------------------

# FSDP2 refuses to shard trainable parameters of two dtypes in one group (float16 blocks with a float32 ``wo``) at
# the first forward, with and without metapatch: loud, so allowed, and reported in the metrics.
_FSDP2_MIXED_DTYPES = "FSDP expects uniform original parameter dtype"


def _eval_prepared(accelerator: Any, flow: str, workdir: Path) -> Dict[str, Any]:
    from metapatch import MetapatchError

    model = _FLOWS[flow][1](_checkpoint(flow, workdir)).eval()
    # before any prepare: only rank 0 loaded; what rank 1 holds, and whether a forward is refused
    results: Dict[str, Any] = {"early_state": {k: (None if v.is_meta else v.detach().clone())
                                               for k, v in model.state_dict().items()}, "early_refused": False}
    try:
        results["early_logits"] = _value(_forward(model, flow))
    except MetapatchError:
        results["early_logits"], results["early_refused"] = None, True
    model = accelerator.prepare_model(model, evaluation_mode=True)
    results["eval_state"], results["eval_logits"] = _full_state(model), _value(_forward(model, flow))
    return results


def _train_prepared(accelerator: Any, flow: str, workdir: Path) -> Dict[str, Any]:
    import torch

    model = _FLOWS[flow][1](_checkpoint(flow, workdir))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.eval()
    try:
        logits = _value(_forward(model, flow))
    except AssertionError as error:
        if _FSDP2_MIXED_DTYPES not in str(error):
            raise
        return {"train_refused": str(error)}
    return {"train_logits": logits, "train_state": _full_state(model)}


Plan = List[Tuple[str, str]]  # (flow, "eval" | "train"), in the order every rank runs them
_LOADING_FLOWS: Plan = [("new-head", "eval"), ("new-head", "train"), ("fp16", "eval"), ("bf16", "eval")]
_TRAIN_HALF: Plan = [("fp16", "train"), ("bf16", "train")]


def _rank(plan: Plan, workdir: Path) -> Dict[str, Any]:
    os.environ.update(FSDP_ENV)
    accelerator = fsdp_accelerator()
    results: Dict[str, Any] = {flow: {} for flow, _ in plan}
    for flow, stage in plan:
        results[flow].update((_eval_prepared if stage == "eval" else _train_prepared)(accelerator, flow, workdir))
    return results


def _loading_flows_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    return _rank(_LOADING_FLOWS, workdir)


def _half_train_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    return _rank(_TRAIN_HALF, workdir)


# -- the comparison ----------------------------------------------------------------------------------

def _state_metrics(got: Dict[str, Any], expected: Dict[str, Any]) -> Dict[str, Any]:
    """The largest difference over the state dict, and the names whose dtype or presence differs."""
    wrong_dtype: List[str] = [k for k in expected if got.get(k) is not None and got[k].dtype != expected[k].dtype]
    missing = [k for k in expected if got.get(k) is None]
    diffs = {k: max_abs_diff(got[k], expected[k]) for k in expected
             if got.get(k) is not None and got[k].shape == expected[k].shape}
    worst = max(diffs, key=diffs.get) if diffs else None
    return {"diff": diffs[worst] if worst else 0.0, "worst": worst, "wrong_dtype": wrong_dtype, "missing": missing}


def _run(plan: Plan, workdir: Path, rank_function: str) -> Dict[str, Any]:
    expected: Dict[str, Any] = {}
    flows = list(dict.fromkeys(flow for flow, _ in plan))
    for flow in flows:
        save, load, _ = _FLOWS[flow]
        if not _checkpoint(flow, workdir).exists():
            save(_checkpoint(flow, workdir))
        reference = load(_checkpoint(flow, workdir)).eval()
        expected[flow] = ({k: v.detach().clone() for k, v in reference.state_dict().items()},
                          _forward(reference, flow))
    reports = run_ranks(rank_function, workdir)
    raise_first_error(reports)
    metrics: Dict[str, Any] = {}
    failures = []
    for report in reports:
        rank = report["rank"]
        for flow in flows:
            result, (expected_state, expected_logits) = report["result"][flow], expected[flow]
            key = f"rank{rank}_{flow}"
            stages = [stage for f, stage in plan if f == flow]
            if "eval" in stages:
                early = _state_metrics(result["early_state"], expected_state)
                metrics[f"{key}_early_meta"] = len(early["missing"])
                early_off = (None if result["early_logits"] is None
                             else max_abs_diff(result["early_logits"], expected_logits))
                metrics[f"{key}_early"] = ("refused" if result["early_refused"] else "meta" if early_off is None else
                                           "equal" if early_off == 0 else f"differs ({early_off:.4g} off)")
            for prepared in stages:
                if prepared == "train" and "train_refused" in result:
                    metrics[f"{key}_train"] = "refused by FSDP2 (two dtypes in one group)"
                    continue
                state = _state_metrics(result[f"{prepared}_state"], expected_state)
                got = result[f"{prepared}_logits"]
                logits = float("nan") if got is None else max_abs_diff(got, expected_logits)
                metrics[f"{key}_{prepared}_logits_diff"] = logits
                metrics[f"{key}_{prepared}_state_diff"] = state["diff"]
                if state["wrong_dtype"] or state["missing"] or state["diff"] > 0 or not logits == 0:
                    failures.append(f"rank {rank} {flow} after {prepared} prepare: state {state['diff']} off "
                                    f"(largest at {state['worst']}), dtype differs for {state['wrong_dtype'][:4]}, "
                                    f"missing {state['missing'][:4]}, logits {logits} off")
    diffs = [v for k, v in metrics.items() if k.endswith(("_logits_diff", "_state_diff"))]
    metrics["max_abs_diff"] = max(diffs) if diffs else 0.0
    if failures:
        raise AssertionError(f"a rank differs from the single-process load: {'; '.join(failures)} ({metrics})")
    return metrics


def _t5_keeps_wo_in_fp32() -> None:
    from transformers import T5ForConditionalGeneration

    if "wo" not in (T5ForConditionalGeneration._keep_in_fp32_modules or ()):
        from . import NotApplicable

        raise NotApplicable("this transformers keeps no T5 module in float32")


def loading_flows_ranks(workdir: Path) -> Dict[str, Any]:
    """Under FSDP2 cpu_ram_efficient_loading, on every rank, the state dict (dtypes and values) and logits equal
    the single-process load's for: a 5-label sequence-classification checkpoint loaded with ``num_labels=2,
    ignore_mismatched_sizes=True`` (a head initialised at load, same seed everywhere) after
    ``prepare_model(evaluation_mode=True)`` and after ``prepare(model, optimizer)``; T5 loaded in float16
    (``wo`` kept in float32) and in bfloat16, after ``prepare_model(evaluation_mode=True)``. Without metapatch
    the new head stays a placeholder on rank 1 after the evaluation prepare (every release measured); the half
    precision loads are right upstream from transformers 5.23 (rank 1 reads the checkpoint) and wrong before
    (rank 1's zeros)."""
    _t5_keeps_wo_in_fp32()
    return _run(_LOADING_FLOWS, workdir, f"{__name__}:_loading_flows_rank")


def half_precision_train_ranks(workdir: Path) -> Dict[str, Any]:
    """T5 loaded in float16 (``wo`` kept in float32) and in bfloat16 through ``accelerator.prepare(model,
    optimizer)``: bfloat16 equals the single-process load on every rank; float16 (float16 blocks with a float32
    ``wo``) is refused by FSDP2 itself at the first forward ("uniform original parameter dtype"), with and
    without metapatch, reported as ``rankN_fp16_train``. Without metapatch T5's embedding tie fails FSDP2's
    duplicate-parameter check first (accelerate 1.14 and later)."""
    _t5_keeps_wo_in_fp32()
    return _run(_TRAIN_HALF, workdir, f"{__name__}:_half_train_rank")
