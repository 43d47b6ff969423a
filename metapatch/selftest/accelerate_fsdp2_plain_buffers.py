"""Two-rank reproducer for ``accelerate-fsdp2-plain-buffers`` (accelerate FSDP2 with
``cpu_ram_efficient_loading``, gloo on CPU): a persistent buffer that is not a parameter (an MoE
gate's ``e_score_correction_bias``) through ``accelerator.prepare``; every rank is compared with the
single-process in-memory reference (:func:`metapatch.selftest._fsdp.compare_ranks`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from ._fsdp import compare_ranks
from ._harness import Scenario
from ._models import input_ids
from ._ranks import FSDP2_ON_CPU, GLOO_RANKS, FSDP_ENV, fsdp_accelerator, run_ranks

PLAIN_BUFFERS = "accelerate-fsdp2-plain-buffers"
_SEED = 0
_STEP_TOLERANCE = 1e-5  # FSDP2 averages the two ranks' gradients: a different summation order


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

    _save_tiny_moe(workdir / "ckpt")
    with torch.no_grad():
        reference = {"logits": AutoModelForCausalLM.from_pretrained(workdir / "ckpt").eval()(input_ids=input_ids()).logits}
    return compare_ranks(run_ranks(f"{__name__}:_moe_rank", workdir), reference, _STEP_TOLERANCE)


SCENARIOS = [
    Scenario(PLAIN_BUFFERS, "persistent-buffer-prepare", f"{__name__}:persistent_buffer_prepare",
             "a DeepSeek-V3-style MoE gate's persistent e_score_correction_bias through accelerator.prepare with FSDP2 cpu_ram_efficient_loading "
             "(two ranks, gloo): every rank's logits equal one process's",
             expected_error="AttributeError", expected_message="has no attribute 'device_mesh'",
             # two-rank FSDP loading was measured from these releases on (other code variants below them)
             requires={"accelerate": ">=1.13", **FSDP2_ON_CPU}, **GLOO_RANKS),
]
