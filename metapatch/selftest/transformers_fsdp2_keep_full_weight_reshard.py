"""Two-rank reproducers for transformers' native FSDP2 loading (``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=2))``, gloo on CPU): an evaluation forward, then an
optimizer built from ``model.parameters()``, two SGD steps (a forward without autograd between the
second one's forward and backward). Every rank must give the single-process in-memory model's logits
after loading and after the steps.

``metrics``: per rank the logits' difference after load and after the step, and how many of the
parameters the optimizer got were not sharded (``rankN_unsharded``: plain tensors that FSDP2 left
registered after the evaluation forward; none in a fixed run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._ranks import FSDP2_TRAINING_ON_CPU, GLOO_RANKS
from ._harness import Scenario
from ._models import input_ids, max_abs_diff

PATCH_ID = "transformers-fsdp2-keep-full-weight-reshard"
_SEED = 0
_LR = 0.5
# FSDP2 averages the two ranks' gradients (same batch on both): another summation order at most.
# Measured: 0.0 on transformers 5.17.0 and 5.24.0.
_TOLERANCE = 1e-5
# transformers 5.15: the first release that shards at load time; torch: transformers' FSDP2 asks for 2.8 ("FSDP2
# requires `torch>=2.8`", distributed checkpoint save/load), and the ranks' training step on the CPU needs 2.9.
_REQUIRES = {"transformers": ">=5.15", **FSDP2_TRAINING_ON_CPU}


def _save(path: Path, architecture: str) -> None:
    import torch

    from ._models import tiny_llama_config

    torch.manual_seed(_SEED)
    if architecture == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True)
        Qwen2ForCausalLM(config).save_pretrained(path)
    else:
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2)).save_pretrained(path)


def _eval_then_step(model: Any) -> Dict[str, Any]:
    """The user's loop: evaluate, build the optimizer, train two steps (the second with a forward
without autograd before its backward), evaluate again."""
    import torch

    ids = input_ids()
    model.eval()
    with torch.no_grad():
        loaded = model(input_ids=ids).logits
    parameters = list(model.parameters())
    from torch.distributed.tensor import DTensor

    # Only meaningful with a process group: in one process no parameter is a DTensor.
    unsharded = sum(not isinstance(p, DTensor) for p in parameters) if torch.distributed.is_initialized() else 0
    optimizer = torch.optim.SGD(parameters, lr=_LR)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    # A forward without autograd between a forward and its backward (a reference pass in RL loops):
    # resharding there must leave the pending backward right (FSDP2 all-gathers again for it).
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        model(input_ids=ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        stepped = model(input_ids=ids).logits
    return {"loaded": loaded, "stepped": stepped, "unsharded": unsharded}


def _rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(workdir / "ckpt",
                                                 distributed_config=DistributedConfig(fsdp_size=world_size))
    return _eval_then_step(model)


def _run(workdir: Path, architecture: str) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ._ranks import raise_first_error, run_ranks

    _save(workdir / "ckpt", architecture)
    reference = _eval_then_step(AutoModelForCausalLM.from_pretrained(workdir / "ckpt"))
    step_change = max_abs_diff(reference["stepped"], reference["loaded"])
    if not step_change > 0:
        raise AssertionError("the optimizer step did not change the logits: the comparison would prove nothing")
    reports = run_ranks(f"{__name__}:_rank", workdir)
    raise_first_error(reports)
    metrics: Dict[str, Any] = {"step_change": step_change}
    for report in reports:
        result, rank = report["result"], report["rank"]
        metrics[f"rank{rank}_unsharded"] = result["unsharded"]
        for key in ("loaded", "stepped"):
            metrics[f"rank{rank}_{key}_diff"] = max_abs_diff(result[key], reference[key])
    metrics["max_abs_diff"] = max(v for k, v in metrics.items() if k.endswith("_diff"))
    if metrics["max_abs_diff"] > _TOLERANCE:
        raise AssertionError(f"a rank differs from the single-process step (an optimizer built after an "
                             f"evaluation forward): {metrics}")
    return metrics


def eval_then_train_llama(workdir: Path) -> Dict[str, Any]:
    """LlamaForCausalLM (untied head): norm and lm_head are the keep_full_weight tail group."""
    return _run(workdir, "llama")


def eval_then_train_tied_qwen2(workdir: Path) -> Dict[str, Any]:
    """Qwen2ForCausalLM with a tied head: the embedding takes the head's keep_full_weight rule."""
    return _run(workdir, "qwen2")


SCENARIOS = [
    Scenario(PATCH_ID, "eval-then-train-llama", f"{__name__}:eval_then_train_llama",
             "from_pretrained(distributed_config=DistributedConfig(fsdp_size=2)) (two ranks, gloo), a no_grad "
             "forward, then SGD over model.parameters() and one step: every rank's logits equal one process's",
             expected_error="AssertionError", expected_message="a rank differs from the single-process step",
             requires=_REQUIRES, tolerance=_TOLERANCE, **GLOO_RANKS),
    Scenario(PATCH_ID, "eval-then-train-tied-qwen2", f"{__name__}:eval_then_train_tied_qwen2",
             "the same with a tied Qwen2 head (the input embedding is the keep_full_weight group)",
             expected_error="AssertionError", expected_message="a rank differs from the single-process step",
             requires=_REQUIRES, tolerance=_TOLERANCE, in_selftest=False, **GLOO_RANKS),
]
