"""fsdp-rank-placeholders: under accelerate FSDP with ``cpu_ram_efficient_loading``, no rank keeps
the placeholders ``from_pretrained`` leaves on ranks != 0.

With ``ACCELERATE_USE_FSDP`` and ``FSDP_CPU_RAM_EFFICIENT_LOADING`` set and a process group up,
transformers materialises the model fully only on local rank 0; the other ranks wait for accelerate's
FSDP2 prepare to broadcast rank 0's state. What they hold until then (measured, two ranks, gloo):
transformers 5.17 gives every parameter and buffer of rank 1 as zeros; 5.24 loads the checkpoint on
rank 1 too but leaves keys missing from it (the new ``score`` head of
``AutoModelForSequenceClassification`` over a causal-LM checkpoint) on meta. A model that is only
evaluated, ``accelerator.prepare_model(model, evaluation_mode=True)`` (reference and reward models),
never gets the broadcast: rank 1's logits are zeros where rank 0's are the model's, with no error
(huggingface/transformers#45050, #44473). Non-persistent buffers are ``zeros_like`` on ranks != 0
and each rank keeps its own copy through FSDP2 prepare, so a buffer that ``_init_weights`` does not
recompute (remote-code rotary tables) differs between ranks (huggingface/transformers#48892).

The fix, three wrappers:
- ``PreTrainedModel._move_missing_keys_from_meta_to_device`` marks the model on every rank (the
  upstream FSDP condition, transformers' own ``is_fsdp_enabled``) and, on ranks != 0, records the
  tensors it left as placeholders (those still on meta, and those it replaced: every tensor on 5.7-5.22,
  whose zeros a model without missing keys, such as T5, otherwise used silently) and adds a forward pre-hook that raises ``MetapatchError`` while
  any of them is still in place: a placeholder is never used silently.
- ``Accelerator.prepare_model(..., evaluation_mode=True)`` on a marked model broadcasts every
  parameter and buffer from rank 0 before preparing (a collective, like accelerate's own FSDP prepare).
- ``fsdp2_prepare_model`` on a marked model broadcasts the non-persistent buffers from rank 0 after
  preparing, so the ranks agree. The value is right, not only shared, because
  ``empty-built-nonpersistent-buffers`` refills on every rank, at load, each buffer ``_init_weights``
  left as the ``empty_like`` (rank 0) or ``zeros_like`` (ranks != 0) placeholder.
Where FSDP loading is not in use, each wrapper's first check returns to upstream untouched.
"""

from __future__ import annotations

from typing import Any

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "fsdp-rank-placeholders"
_LOADED = "_metapatch_fsdp_loaded"
_PLACEHOLDERS = "_metapatch_fsdp_placeholders"


def _move_missing_keys(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    upstream = getattr(wrapped, "__globals__", {})
    is_fsdp_enabled = upstream.get("is_fsdp_enabled")
    if instance is None or is_fsdp_enabled is None or not is_fsdp_enabled():
        return wrapped(*args, **kwargs)
    bound = signature_of(wrapped.__func__).bind_partial(instance, *args, **kwargs)
    if bound.arguments.get("hf_quantizer") is not None or upstream["is_local_dist_rank_0"]():
        result = wrapped(*args, **kwargs)
        setattr(instance, _LOADED, True)
        return result
    from metapatch._offload.rank_sync import model_entries

    # What upstream leaves on this rank in place of rank 0's values: the tensors still on meta when it is called
    # (missing keys, non-persistent buffers) and those it replaces (transformers 5.7-5.22 put zeros in place of
    # every parameter and buffer, the checkpoint's included).
    before = [(entry, _tensor(entry)) for entry in model_entries(instance)]
    result = wrapped(*args, **kwargs)
    placeholders = [(entry, _tensor(entry)) for entry, tensor in before
                    if tensor.is_meta or _tensor(entry) is not tensor]
    setattr(instance, _LOADED, True)
    if placeholders:
        setattr(instance, _PLACEHOLDERS, placeholders)
        instance.register_forward_pre_hook(_refuse_placeholders)
    return result


def _tensor(entry: Any) -> Any:
    _, module, kind, name = entry
    return (module._parameters if kind == "param" else module._buffers)[name]


def _still_placeholders(model: Any) -> list:
    left = [(entry, tensor) for entry, tensor in getattr(model, _PLACEHOLDERS, ()) if _tensor(entry) is tensor]
    setattr(model, _PLACEHOLDERS, left)
    return left


def _refuse_placeholders(module: Any, args: Any) -> None:
    left = _still_placeholders(module)
    if left:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else "?"
        names = ", ".join(entry[0] for entry, _ in left[:5]) + (" and more" if len(left) > 5 else "")
        raise MetapatchError(
            f"metapatch: rank {rank} still holds the placeholders from_pretrained leaves on ranks != 0 under FSDP "
            f"cpu_ram_efficient_loading ({len(left)} tensors: {names}); only rank 0 loaded them. Prepare the model "
            "on every rank first: accelerator.prepare(model) for training, accelerator.prepare_model(model, "
            "evaluation_mode=True) for evaluation (metapatch broadcasts rank 0's weights there).")


def _prepare_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped.__func__).bind_partial(instance, *args, **kwargs)
    model = bound.arguments.get("model")
    if not bound.arguments.get("evaluation_mode") or model is None:
        return wrapped(*args, **kwargs)
    from metapatch._offload.rank_sync import broadcast_from_rank0, marked, model_entries

    if marked(model, _LOADED) and _group_up():
        broadcast_from_rank0(model, model_entries(model), "weights for an evaluation-only model")
        for module in model.modules():
            if getattr(module, _PLACEHOLDERS, None):
                setattr(module, _PLACEHOLDERS, [])
    return wrapped(*args, **kwargs)


def _fsdp2_prepare_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    model = bound.arguments.get("model")
    from metapatch._offload.rank_sync import marked

    if model is None or not marked(model, _LOADED) or not _group_up():
        return wrapped(*args, **kwargs)
    prepared = wrapped(*args, **kwargs)
    from metapatch._offload.rank_sync import broadcast_from_rank0, model_entries

    broadcast_from_rank0(prepared, model_entries(prepared, "non-persistent"), "non-persistent buffers")
    return prepared


def _group_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


PATCH = Patch(
    id=PATCH_ID,
    title="FSDP cpu_ram_efficient_loading: ranks != 0 never keep from_pretrained's placeholders "
          "(evaluation-only models, missing keys, non-persistent buffers)",
    # Measured (two ranks, gloo): transformers 5.11.0 / accelerate 1.13.0 and 5.17.0 / 1.14.0 (every
    # rank-1 tensor zeros), 5.24.0 / 1.15.0 (missing keys on meta). Releases before 5.7 and 1.13 have
    # other variants of the targets (survey table) and are not claimed until measured.
    affects={"transformers": ">=5.7", "accelerate": ">=1.13"},
    targets=(
        Target("transformers.modeling_utils", "PreTrainedModel._move_missing_keys_from_meta_to_device",
               fingerprints=shared_fingerprints(
                   "transformers.modeling_utils:PreTrainedModel._move_missing_keys_from_meta_to_device"),
               wrapper=_move_missing_keys),
        Target("accelerate.accelerator", "Accelerator.prepare_model",
               fingerprints=("aad7fb2d2c1ed103",  # accelerate 1.13.0
                             "2b6563672810ed61",  # accelerate 1.14.0
                             "39d2ccde29f46bbe",  # accelerate 1.15.0
                             "2aa5f42d920681ec"),  # accelerate 1.16.0 (TPU re-tie, env parsing: same flow)
               wrapper=_prepare_model),
        Target("accelerate.utils.fsdp_utils", "fsdp2_prepare_model",
               fingerprints=shared_fingerprints("accelerate.utils.fsdp_utils:fsdp2_prepare_model"),
               wrapper=_fsdp2_prepare_model,
               aliases=("accelerate.utils:fsdp2_prepare_model", "accelerate.accelerator:fsdp2_prepare_model")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/issues/45050",
             "https://github.com/huggingface/transformers/issues/44473",
             "https://github.com/huggingface/transformers/issues/48892"),
        forwarded="no",
        note="accelerate: prepare_model(evaluation_mode=True) and fsdp2_prepare_model broadcast rank 0's "
             "state to a model loaded with cpu_ram_efficient_loading",
    ),
    # Outermost on both shared targets, the order the two-rank tests measured: the buffer refill runs inside
    # the placeholder bookkeeping at load, and the shared-embedding grouping inside the broadcast at prepare.
    wraps_over=("accelerate-fsdp2-shared-embeddings", "empty-built-nonpersistent-buffers"),
)
