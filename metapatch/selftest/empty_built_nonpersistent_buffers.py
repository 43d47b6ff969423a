"""Reproducers for ``empty-built-nonpersistent-buffers``: non-persistent buffers of models that
transformers 5 ``from_pretrained`` builds on meta.

A non-persistent buffer is never in a checkpoint: it has the value its module's constructor computes
or none at all. transformers 5 ``from_pretrained`` builds on meta and gives every non-persistent buffer
``torch.empty_like`` memory (``zeros_like`` on FSDP ranks != 0), counting on ``_init_weights`` to
recompute it; a custom (remote-code style) module's buffer that ``_init_weights`` does not know keeps
the garbage (huggingface/transformers#48892). The model here is a registered custom class
(``AutoConfig``/``AutoModelForCausalLM``) whose rotary-style ``inv_freq`` is such a buffer.

Uninitialised memory can by chance hold the right bytes, so the scenarios make it deterministic: while
the load runs, ``torch.empty_like`` returns memory filled with NaN (``_models.nan_sentinel``, a sentinel
of the scenario only; the patch detects unwritten buffers by tensor identity and version, never by
value). Fixed means the loaded model's buffers and logits equal (torch.equal) the model built
normally in memory, both computing on the execution device (``_device``; the two-rank scenario is pinned
to the CPU).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from ._ranks import GLOO_RANKS
from ._harness import Scenario
from ._models import device_input_ids, input_ids, max_abs_diff, nan_sentinel

FROM_PRETRAINED = "empty-built-nonpersistent-buffers"
_VOCAB = 128


# Measured on transformers 4.x and >= 5.7; 5.0-5.6 load through other variants of the code (4.x builds buffers on
# the CPU: passes).
_MEASURED = {"transformers": "!=5.0.*,!=5.1.*,!=5.2.*,!=5.3.*,!=5.4.*,!=5.5.*,!=5.6.*"}
# Two-rank FSDP loading was measured from transformers 5.7 / accelerate 1.13 on.
_MEASURED_RANKS = {"transformers": ">=5.7", "accelerate": ">=1.13"}


# -- a remote-code style model: a rotary table that _init_weights does not recompute -------------

def register_table_model() -> Any:
    """Define (once) and register a custom causal LM whose ``inv_freq`` is a non-persistent buffer
    only its constructor computes; returns the model class."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    existing = globals().get("_TABLE_MODEL")
    if existing is not None:
        return existing

    class TableRopeConfig(PretrainedConfig):
        model_type = "metapatch-table-rope"

        def __init__(self, vocab_size: int = _VOCAB, hidden_size: int = 32, base: float = 100.0, **kwargs: Any):
            self.vocab_size, self.hidden_size, self.base = vocab_size, hidden_size, base
            super().__init__(**kwargs)

    class TableRope(nn.Module):  # not "...RotaryEmbedding": transformers' stock rotary init skips it
        def __init__(self, dim: int, base: float):
            super().__init__()
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        def forward(self, x: Any) -> Any:
            angles = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)[:, None] * self.inv_freq
            return x * torch.cat([angles.cos(), angles.sin()], dim=-1)

    class TableBlock(nn.Module):
        def __init__(self, config: Any):
            super().__init__()
            self.proj = nn.Linear(config.hidden_size, config.hidden_size)
            self.rope = TableRope(config.hidden_size, config.base)

        def forward(self, x: Any) -> Any:
            return x + self.proj(self.rope(x))

    class TableRopeForCausalLM(PreTrainedModel):
        config_class = TableRopeConfig
        _no_split_modules = ["TableBlock"]

        def __init__(self, config: Any):
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.block = TableBlock(config)
            self.head = nn.Linear(config.hidden_size, config.vocab_size)
            self.post_init()

        def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
            return CausalLMOutput(logits=self.head(self.block(self.embed(input_ids))))

    for cls in (TableRopeConfig, TableRope, TableBlock, TableRopeForCausalLM):
        cls.__module__ = __name__
    AutoConfig.register(TableRopeConfig.model_type, TableRopeConfig, exist_ok=True)
    AutoModelForCausalLM.register(TableRopeConfig, TableRopeForCausalLM, exist_ok=True)
    globals().update(_TABLE_MODEL=TableRopeForCausalLM, TableRopeConfig=TableRopeConfig, TableRope=TableRope,
                     TableBlock=TableBlock, TableRopeForCausalLM=TableRopeForCausalLM)
    return TableRopeForCausalLM


def save_table_model(path: Path, seed: int = 0) -> Any:
    """Save a random table model; returns the in-memory model (eval)."""
    import torch

    cls = register_table_model()
    torch.manual_seed(seed)
    model = cls(cls.config_class()).eval()
    model.save_pretrained(path)
    return model


def _compare_table(model: Any, reference: Any) -> Dict[str, Any]:
    """``model`` (as loaded) against the in-memory ``reference`` (built on the CPU, moved to the execution
    device here): the buffer as the constructor computed it, and the logits."""
    import torch

    from ._device import to_device

    got_buffer, want_buffer = model.block.rope.inv_freq, reference.block.rope.inv_freq
    if not torch.equal(got_buffer.cpu(), want_buffer.cpu()):
        raise AssertionError(f"block.rope.inv_freq {got_buffer[:4].tolist()}... != constructor's {want_buffer[:4].tolist()}...")
    ids = device_input_ids(_VOCAB)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, to_device(reference)(input_ids=ids).logits
    if not torch.equal(got.cpu(), want.cpu()):
        raise AssertionError(f"logits differ: max abs diff {max_abs_diff(got, want)}")
    return {"max_abs_diff": 0.0}


def custom_buffer_in_memory(workdir: Path) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ._device import to_device

    reference = save_table_model(workdir / "ckpt")
    with nan_sentinel():
        model = AutoModelForCausalLM.from_pretrained(workdir / "ckpt").eval()
    return _compare_table(to_device(model), reference)


def custom_buffer_offloaded(workdir: Path) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ._device import main_device

    reference = save_table_model(workdir / "ckpt")
    device_map = {"embed": main_device(), "block": "disk", "head": main_device()}
    with nan_sentinel():
        model = AutoModelForCausalLM.from_pretrained(workdir / "ckpt", device_map=device_map,
                                                     offload_folder=str(workdir / "offload")).eval()
    if not model.block.proj.weight.is_meta:
        raise AssertionError("block was not offloaded to disk: the scenario would not test an offloaded load")
    return _compare_table(model, reference)


# -- two ranks: FSDP cpu_ram_efficient_loading (ranks != 0 get zeros_like) -------------------------

def _fsdp_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from ._ranks import FSDP_ENV, fsdp_accelerator

    register_table_model()
    os.environ.update(FSDP_ENV)
    accelerator = fsdp_accelerator()
    with nan_sentinel():
        model = AutoModelForCausalLM.from_pretrained(workdir / "ckpt").eval()
    loaded = model.block.rope.inv_freq.detach().clone()
    model = accelerator.prepare_model(model, evaluation_mode=True)
    with torch.no_grad():
        logits = model(input_ids=input_ids(_VOCAB)).logits
    return {"loaded": loaded, "prepared": accelerator.unwrap_model(model).block.rope.inv_freq.detach().clone(),
            "logits": logits}


def fsdp_ranks_buffer(workdir: Path) -> Dict[str, Any]:
    """Two ranks (gloo) load the custom model under FSDP cpu_ram_efficient_loading and prepare it for
    evaluation: each rank's inv_freq right after loading, after prepare, and its logits equal the
    model built in memory."""
    import torch

    from ._ranks import raise_first_error, run_ranks

    reference = save_table_model(workdir / "ckpt")
    with torch.no_grad():
        want = {"loaded": reference.block.rope.inv_freq, "prepared": reference.block.rope.inv_freq,
                "logits": reference(input_ids=input_ids(_VOCAB)).logits}
    reports = run_ranks(f"{__name__}:_fsdp_rank", workdir)
    raise_first_error(reports)
    metrics: Dict[str, Any] = {}
    for report in reports:
        for key, expected in want.items():
            got = report["result"][key]
            metrics[f"rank{report['rank']}_{key}_diff"] = max_abs_diff(got, expected)
            metrics[f"rank{report['rank']}_{key}_equal"] = bool(torch.equal(got, expected))
    diffs = [v for k, v in metrics.items() if k.endswith("_diff")]
    metrics["max_abs_diff"] = float("nan") if any(d != d for d in diffs) else max(diffs)
    if not all(v for k, v in metrics.items() if k.endswith("_equal")):
        raise AssertionError(f"a rank's non-persistent buffer or logits differ from the in-memory model: {metrics}")
    return metrics


SCENARIOS = [
    Scenario(FROM_PRETRAINED, "custom-buffer-in-memory", f"{__name__}:custom_buffer_in_memory",
             "a registered custom causal LM whose rotary inv_freq (non-persistent) _init_weights does not recompute, "
             "plain from_pretrained: buffer and logits equal the in-memory model (unpatched: empty_like memory)",
             expected_error="AssertionError", requires=_MEASURED),
    Scenario(FROM_PRETRAINED, "custom-buffer-offloaded", f"{__name__}:custom_buffer_offloaded",
             "the same with device_map embed/head on cpu, the block (holding the buffer) on disk",
             expected_error="AssertionError", requires=_MEASURED),
    Scenario(FROM_PRETRAINED, "fsdp-ranks-buffer", f"{__name__}:fsdp_ranks_buffer",
             "the same under FSDP cpu_ram_efficient_loading, two ranks (gloo), prepare_model(evaluation_mode=True): "
             "every rank's buffer after load and prepare, and its logits, equal the in-memory model "
             "(unpatched: rank 0 empty_like, rank 1 zeros)",
             expected_error="AssertionError", in_selftest=False, requires=_MEASURED_RANKS, **GLOO_RANKS),
]
