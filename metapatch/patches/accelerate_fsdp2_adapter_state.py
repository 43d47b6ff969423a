"""accelerate-fsdp2-adapter-state: ``save_fsdp_model(..., adapter_only=True)`` and
``load_fsdp_model(..., adapter_only=True)`` with FSDP2 and ``FULL_STATE_DICT`` keep every rank's
shard of the adapter.

accelerate <= 1.14 takes the adapter's state dict with ``get_peft_model_state_dict``, which under
FSDP2 holds the parameters' DTensors. Rank 0 then pickles its DTensors: the file holds rank 0's
local shard of each LoRA tensor only (``lora_A`` of r=4 on two ranks: a (2, 64) local tensor under a
(4, 64) global shape), and nothing of the other ranks' halves, with no error. Loading goes through
``set_peft_model_state_dict`` on every rank while only rank 0 read the file, so the other ranks keep
what they had. ``transformers.Trainer`` always saves this way under FSDP (``adapter_only=True``):
resuming from such a checkpoint reverts ``(N-1)/N`` of the adapter (huggingface/accelerate#4206;
accelerate 1.15 gathers trainable parameters instead, under the model's own key names).

Here the adapter keeps peft's key names and the file format of the release (so a file written by a
patched 1.14 loads with its own ``load_fsdp_model``, in one process too) but every sharded entry is
gathered (``full_tensor``, a collective on every rank) before rank 0 writes it. Loading broadcasts
rank 0's full tensors and puts each rank's shard into the parameter (``distribute_tensor``). A file
that an unpatched release wrote (DTensors, rank 0's shard only) is refused with MetapatchError: the
other ranks' halves are not in it. Calls other than FSDP2 + FULL_STATE_DICT + a PEFT model go to
upstream untouched.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream

PATCH_ID = "accelerate-fsdp2-adapter-state"


def _applies(bound: Any) -> bool:
    args = bound.arguments
    options = args.get("sd_options")
    if not (args.get("adapter_only") and options is not None and getattr(options, "full_state_dict", False)):
        return False
    from accelerate.utils import is_peft_model

    return is_peft_model(args["model"])


def _adapter_view(model: Any) -> Dict[str, Any]:
    """peft's adapter state dict of ``model`` with the model's own state-dict entries as values
    (DTensors under FSDP2), so each adapter key can be traced back to the model's key."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=model.state_dict(), adapter_name=model.active_adapter)


def _get_state_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind(*args, **kwargs)
    if not _applies(bound):
        return wrapped(*args, **kwargs)
    from torch.distributed.tensor import DTensor

    offload = bool(getattr(bound.arguments["sd_options"], "cpu_offload", False))
    full = {}
    for key, value in _adapter_view(bound.arguments["model"]).items():  # same order on every rank
        if isinstance(value, DTensor):
            value = value.full_tensor()
        full[key] = value.detach().to("cpu") if offload else value.detach()
    return full


def _model_keys(model: Any) -> Dict[str, str]:
    entries = model.state_dict()
    by_id = {id(value): key for key, value in entries.items()}
    from peft import get_peft_model_state_dict

    view = get_peft_model_state_dict(model, state_dict=entries, adapter_name=model.active_adapter)
    return {key: by_id[id(value)] for key, value in view.items() if id(value) in by_id}


def _set_state_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind(*args, **kwargs)
    if not _applies(bound):
        return wrapped(*args, **kwargs)
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    model, state_dict = bound.arguments["model"], bound.arguments["state_dict"] or {}
    model_keys = _model_keys(model)
    verdict: List[Optional[Any]] = [None]
    if dist.get_rank() == 0:  # only rank 0 read the file (broadcast_from_rank0)
        sharded = [k for k, v in state_dict.items() if isinstance(v, DTensor)]
        unknown = [k for k in state_dict if k not in model_keys]
        if sharded:
            verdict[0] = ("sharded", sharded)
        elif unknown:
            verdict[0] = ("unknown", unknown)
        else:
            verdict[0] = ("keys", list(state_dict))
    dist.broadcast_object_list(verdict, src=0)  # every rank learns rank 0's answer before any tensor moves
    kind, keys = verdict[0]
    if kind == "sharded":
        raise MetapatchError(
            f"metapatch: this adapter file holds DTensors ({keys[:3]}...): it was written by "
            "save_fsdp_model(adapter_only=True) without metapatch on accelerate < 1.15 and holds rank 0's "
            "shard of each adapter tensor only; the other ranks' shards are lost. Save it again with metapatch "
            "active (or accelerate >= 1.15) from a model that still holds the full adapter.")
    if kind == "unknown":
        raise MetapatchError(f"metapatch: the adapter file has keys this model's adapter "
                             f"'{model.active_adapter}' does not have: {keys[:5]}; nothing was loaded.")
    missing = [k for k in model_keys if k not in keys]
    for key in keys:
        parameter = model.get_parameter(model_keys[key])
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        # the group's backend decides the device a broadcast can take (nccl: the GPU)
        device = local.device if local.device.type != "meta" else torch.device("cpu")
        if dist.get_rank() == 0:
            full = state_dict[key].detach().to(device=device, dtype=parameter.dtype).contiguous()
        else:
            full = torch.empty(parameter.shape, dtype=parameter.dtype, device=device)
        dist.broadcast(full, src=0)
        with torch.no_grad():
            if isinstance(parameter, DTensor):
                shard = distribute_tensor(full, parameter.device_mesh, parameter.placements, src_data_rank=None)
                local.copy_(shard.to_local())
            else:
                local.copy_(full)
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(missing_keys=missing, unexpected_keys=[])


PATCH = Patch(
    id=PATCH_ID,
    title="accelerate FSDP2 FULL_STATE_DICT save/load_fsdp_model(adapter_only=True) keep every rank's "
          "adapter shard (no silently truncated LoRA checkpoint)",
    # Measured (two ranks, gloo): 1.13.0 and 1.14.0 affected, 1.15.0 fixed (huggingface/accelerate#4206).
    affects={"accelerate": ">=1.13,<1.15"},
    targets=(
        Target("accelerate.utils.fsdp_utils", "_get_model_state_dict",
               fingerprints=("5cc41f7d055e4a0f",),  # accelerate 1.13.0, 1.14.0
               wrapper=_get_state_dict),
        Target("accelerate.utils.fsdp_utils", "_set_model_state_dict",
               fingerprints=("482983c6753f93f4",),  # accelerate 1.13.0, 1.14.0
               wrapper=_set_state_dict),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/pull/4206",),
        forwarded="no",
        fixed_in={"accelerate": "1.15.0"},
        note="fixed in accelerate 1.15.0 by huggingface/accelerate#4206 (trainable parameters gathered under "
             "the model's key names); the diff here is a backport for 1.14 that keeps peft's key names",
    ),
)
