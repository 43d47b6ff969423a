"""Two-rank reproducer for ``peft-tp-shard-import`` (gloo on CPU): ``PeftModel.from_pretrained`` on
every rank of a running process group, compared with the adapter loaded in one process without a
group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._fsdp import compare_ranks, lora_model
from ._harness import Scenario
from ._models import input_ids, save_tiny_llama
from ._ranks import GLOO_RANKS, backend, run_ranks

TP_IMPORT = "peft-tp-shard-import"


# -- PeftModel.from_pretrained while a process group is running ------------------------------------

def _load_rank(rank: int, world_size: int, workdir: Path) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dist.init_process_group(backend())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(workdir / "ckpt"), workdir / "adapter").eval()
    with torch.no_grad():
        return {"logits": model(input_ids=input_ids()).logits}


def adapter_load_under_group(workdir: Path) -> Dict[str, Any]:
    """A saved non-zero LoRA adapter loaded with ``PeftModel.from_pretrained`` on each of two ranks
    of a running gloo group (as any FSDP/DDP/DeepSpeed script does): every rank's logits equal the
    adapter loaded in one process without a group."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    save_tiny_llama(workdir / "ckpt")
    lora_model(workdir / "ckpt").save_pretrained(workdir / "adapter")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(workdir / "ckpt"), workdir / "adapter").eval()
    with torch.no_grad():
        logits = reference(input_ids=input_ids()).logits
    return compare_ranks(run_ranks(f"{__name__}:_load_rank", workdir), {"logits": logits})


SCENARIOS = [
    Scenario(TP_IMPORT, "adapter-load-under-group", f"{__name__}:adapter_load_under_group",
             "PeftModel.from_pretrained on two ranks of a running gloo group: every rank's logits equal "
             "one process's",
             expected_error="ImportError", expected_message="cannot import name 'EmbeddingParallel'",
             # two-rank FSDP loading was measured from these releases on (other code variants below them)
             requires={"peft": ">=0.19"}, **GLOO_RANKS),
]
