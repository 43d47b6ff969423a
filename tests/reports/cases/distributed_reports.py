"""Reproducers of reports about LoRA adapters and tied weights on two ranks (gloo on CPU). Each runs
the flow the report describes through metapatch's two-rank harness (metapatch.selftest._ranks) and
compares every rank, and any file written, with one process; the ranks inherit this leg's
METAPATCH_DISABLE, so both legs of a report run really differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict


def fsdp2_adapter_only_full_state_dict(workdir: Path) -> Dict[str, Any]:
    """accelerate#4206: LoRA over FSDP2, ``save_fsdp_model(adapter_only=True)`` with FULL_STATE_DICT (what
    Trainer does), then ``load_fsdp_model``: the file holds rank 0's shard of each adapter tensor only."""
    from metapatch.selftest.accelerate_fsdp2_adapter_state import adapter_save_reload

    return adapter_save_reload(workdir)


def adapter_load_under_process_group(workdir: Path) -> Dict[str, Any]:
    """peft#3628: ``PeftModel.from_pretrained`` on each rank of a running process group fails with
    ``cannot import name 'EmbeddingParallel'`` (peft 0.19, transformers >= 5.16)."""
    from metapatch.selftest.peft_tp_shard_import import adapter_load_under_group

    return adapter_load_under_group(workdir)


def fsdp2_tied_embeddings(workdir: Path) -> Dict[str, Any]:
    """accelerate#4171: a tied causal LM through accelerate's FSDP2 prepare with torch >= 2.13, one
    training step: ``shared with a parameter already managed by another FSDP group`` on 1.14."""
    from metapatch.selftest.accelerate_fsdp2_shared_embeddings import tied_causal_lm

    return tied_causal_lm(workdir)
