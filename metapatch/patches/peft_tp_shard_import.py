"""peft-tp-shard-import: loading a LoRA adapter while a process group is running works on peft
0.19 with transformers >= 5.16.

``set_peft_model_state_dict`` calls ``_maybe_shard_state_dict_for_tp`` whenever
``torch.distributed`` is initialised (any FSDP, DDP, DeepSpeed or plain ``init_process_group``
run), and that function imports ``EmbeddingParallel`` from ``transformers.integrations.tensor_parallel``
before it looks at the model. transformers 5.16 moved tensor parallelism to DTensors and the name
is gone, so every adapter load under a process group fails with ``ImportError: cannot import name
'EmbeddingParallel'`` (``PeftModel.from_pretrained``, ``load_adapter``, accelerate's
``load_fsdp_model(adapter_only=True)``), tensor parallelism or not (huggingface/peft#3628, reported
for 0.19-0.20; peft 0.20.0 already looks at the model first, its function is 0.21.2's).

The wrapper does the same look first: a model none of whose LoRA base layers carries a tensor-parallel
plan (``_hf_tp_plan`` and ``_hf_device_mesh``, which only transformers' pre-DTensor TP loading set)
has nothing to shard, and the function returns as upstream's loop would. A model that does carry
such a plan goes to upstream; its ImportError there becomes a MetapatchError saying to upgrade peft.
"""

from __future__ import annotations

from typing import Any

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream

PATCH_ID = "peft-tp-shard-import"


def _has_tp_plan(model: Any) -> bool:
    from peft.tuners.lora.layer import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            if getattr(base, "_hf_tp_plan", None) is not None and getattr(base, "_hf_device_mesh", None) is not None:
                return True
    return False


def _maybe_shard(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    model = signature_of(wrapped).bind(*args, **kwargs).arguments["model"]
    if not _has_tp_plan(model):
        return None  # upstream shards in place and returns None; with no TP layer it changes nothing
    try:
        return wrapped(*args, **kwargs)
    except ImportError as exc:
        raise MetapatchError(
            "metapatch: this model's LoRA layers carry a tensor-parallel plan, and this peft shards such "
            f"adapters with transformers' pre-5.16 tensor-parallel classes ({exc}). Upgrade peft to 0.20 or "
            "later, or use transformers < 5.16 with this peft.") from exc


PATCH = Patch(
    id=PATCH_ID,
    title="peft 0.19 loads LoRA adapters under a running process group with transformers >= 5.16 "
          "(no ImportError: cannot import name 'EmbeddingParallel')",
    # Measured (two ranks, gloo): peft 0.19.1 with transformers 5.17.0 affected; peft 0.20.0 (same
    # function as 0.21.2) passes with 5.24.0. 0.19.0 has 0.19.1's function. transformers 5.16 is
    # where the name left tensor_parallel.
    affects={"peft": ">=0.19,<0.20", "transformers": ">=5.16"},
    targets=(
        Target("peft.utils.save_and_load", "_maybe_shard_state_dict_for_tp",
               fingerprints=("e473142fd7f78750",),  # peft 0.19.0, 0.19.1
               wrapper=_maybe_shard),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/peft/issues/3628",),
        forwarded="no",
        fixed_in={"peft": "0.20.0"},
        note="fixed in peft 0.20.0 (the model is searched for tensor-parallel layers before the import); "
             "the diff is that order for 0.19.1",
    ),
)
