"""accelerate-fsdp2-plain-buffers: ``fsdp2_load_full_state_dict`` (accelerate FSDP2 with
``cpu_ram_efficient_loading``) loads persistent buffers, which ``fully_shard`` leaves as plain tensors.

The function walks the model's state dict after ``fully_shard`` and reads ``.device_mesh`` and
``.placements`` of every entry, as if each were a sharded parameter (a DTensor). Persistent buffers
are in the state dict but are never sharded, so any model with one fails in ``accelerator.prepare``:
``AttributeError: 'Tensor' object has no attribute 'device_mesh'`` (BART's ``final_logits_bias``,
the ``e_score_correction_bias`` of DeepSeek-V3-style MoE gates; huggingface/accelerate#3898, both fix
PRs closed unmerged). Measured on accelerate 1.13.0, 1.14.0 and 1.15.0 with two ranks (gloo).

The wrapper takes the plain entries out of the state dicts upstream sees (the model's: marked
non-persistent for the duration of the call, so upstream's strict ``load_state_dict`` does not expect
them; rank 0's full one: filtered, since accelerate 1.13 zips the two), lets
upstream load the sharded parameters, restores the buffers' persistence and broadcasts each buffer
from rank 0's full state dict to every rank, unsharded, as FSDP2 keeps buffers. A model whose state
dict holds only DTensors goes to upstream untouched.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream

PATCH_ID = "accelerate-fsdp2-plain-buffers"


def _plain_entries(model: Any) -> List[Tuple[str, Any, str]]:
    from torch.distributed.tensor import DTensor

    found = []
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set and not isinstance(buffer, DTensor):
                found.append((f"{module_name}.{name}" if module_name else name, module, name))
    return found


def _load_full_state_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    model = bound.arguments.get("model")
    plain = _plain_entries(model) if model is not None else []
    if not plain:
        return wrapped(*args, **kwargs)
    full_sd = bound.arguments.get("full_sd") or {}
    names = {fqn for fqn, _, _ in plain}
    # Out of both sides: accelerate <= 1.13 zips rank 0's full state dict with the model's entries.
    bound.arguments["full_sd"] = {key: value for key, value in full_sd.items() if key not in names}
    for _, module, name in plain:
        module._non_persistent_buffers_set.add(name)
    try:
        result = wrapped(*bound.args, **bound.kwargs)
    finally:
        for _, module, name in plain:
            module._non_persistent_buffers_set.discard(name)
    _broadcast_buffers(bound.arguments["accelerator"], plain, full_sd, bool(bound.arguments.get("cpu_offload", False)))
    return result


def _broadcast_buffers(accelerator: Any, plain: List[Tuple[str, Any, str]], full_sd: dict, cpu_offload: bool) -> None:
    import torch
    import torch.distributed as dist

    main = accelerator.is_main_process
    absent = [fqn for fqn, _, _ in plain if fqn not in full_sd] if main else []
    verdict = [absent]
    dist.broadcast_object_list(verdict, src=0)  # every rank learns rank 0's answer before any tensor moves
    if verdict[0]:
        raise MetapatchError(f"metapatch: rank 0's full state dict lacks the persistent buffers {verdict[0][:5]}; "
                             "there is nothing to broadcast to the other ranks.")
    # nccl alone cannot send CPU tensors (accelerate's "cuda:nccl,cpu:gloo" can): send on the accelerator's device.
    device = accelerator.device
    for fqn, module, name in plain:
        template = module._buffers[name]
        if main:
            value = full_sd[fqn].detach().to(device=device, dtype=template.dtype).contiguous()
        else:
            value = torch.empty(template.shape, dtype=template.dtype, device=device)
        dist.broadcast(value, src=0)
        module._buffers[name] = value.to("cpu") if cpu_offload else value


PATCH = Patch(
    id=PATCH_ID,
    title="accelerate FSDP2 cpu_ram_efficient_loading loads persistent buffers (no 'Tensor' has no "
          "attribute 'device_mesh'; BART final_logits_bias, MoE e_score_correction_bias)",
    # Measured (two ranks, gloo): 1.13.0, 1.14.0 and 1.15.0 affected; 1.16.0 fixed (its
    # fsdp2_load_full_state_dict broadcasts a plain tensor whole, distributing DTensors only: the
    # scenarios pass unpatched). Earlier releases have other variants of the function (survey table)
    # and are not claimed until measured.
    affects={"accelerate": ">=1.13,<1.16"},
    targets=(
        Target("accelerate.utils.fsdp_utils", "fsdp2_load_full_state_dict",
               fingerprints=("e1540c0e57436bb2",  # accelerate 1.13.0
                             "1081cdc7e47bd279"),  # accelerate 1.14.0, 1.15.0
               wrapper=_load_full_state_dict,
               aliases=("accelerate.utils:fsdp2_load_full_state_dict",)),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues/3898",),
        forwarded="no",
        note="accelerate: fsdp2_load_full_state_dict broadcasts entries that are not DTensors as plain tensors",
    ),
)
