"""empty-built-nonpersistent-buffers: after ``from_pretrained``, no non-persistent buffer holds the
uninitialised memory transformers gave it.

transformers 5 builds the model on meta, so every buffer is computed on meta; a non-persistent buffer
is never in the checkpoint, and ``_move_missing_keys_from_meta_to_device`` materialises each one with
``torch.empty_like`` (``zeros_like`` on ranks != 0 under FSDP ``cpu_ram_efficient_loading``), counting
on ``_init_weights`` to recompute it. Stock rotary embeddings are recomputed there; a buffer that a
model's ``_init_weights`` does not know (``trust_remote_code`` rotary tables, position ids, masks)
keeps the garbage: silently wrong logits in one process, ranks that disagree under FSDP
(huggingface/transformers#48892).

Two wrappers: ``_move_missing_keys_from_meta_to_device`` records each non-persistent buffer tensor it
materialised with its ``_version``; ``_initialize_missing_keys`` then refills those that are still the
same tensor at the same version (nothing wrote them) with the value the model's own constructor
computes, from a rebuild of the model from its config with parameters on meta
(``metapatch._offload.buffer_rebuild``); one that cannot be recomputed raises ``MetapatchError`` naming it. A
model without non-persistent buffers, or whose ``_init_weights`` wrote them all, is left as upstream.
"""

from __future__ import annotations

from typing import Any

from metapatch._framework.records import Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "empty-built-nonpersistent-buffers"
_PENDING = "_metapatch_materialised_buffers"


def _move_missing_keys(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    if instance is not None:
        from metapatch._offload.buffer_rebuild import record

        # every non-persistent buffer was on meta and is a fresh empty_like / zeros_like tensor now
        pending = record(instance)
        if pending:
            instance.__dict__[_PENDING] = pending
    return result


def _initialize_missing_keys(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    pending = instance.__dict__.pop(_PENDING, None) if instance is not None else None
    if pending:
        from metapatch._offload.buffer_rebuild import refill

        refill(instance, pending, "from_pretrained")
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="from_pretrained: non-persistent buffers that _init_weights does not recompute get their "
          "constructor's value, not empty_like memory (every rank under FSDP loading too)",
    # Measured: 5.24.0 and 5.17.0 garbage (one process) / zeros (FSDP rank 1); 5.11.0 and 5.7.0 share the
    # 5.11 variant of the target. transformers 4.x builds buffers on the CPU (not affected).
    affects={"transformers": ">=5.7"},
    targets=(
        Target("transformers.modeling_utils", "PreTrainedModel._move_missing_keys_from_meta_to_device",
               fingerprints=shared_fingerprints(
                   "transformers.modeling_utils:PreTrainedModel._move_missing_keys_from_meta_to_device"),
               wrapper=_move_missing_keys),
        Target("transformers.modeling_utils", "PreTrainedModel._initialize_missing_keys",
               fingerprints=("8b211544bd4de84a",),  # transformers 5.7.0 .. 5.24.0
               wrapper=_initialize_missing_keys),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/issues/48892",),
        forwarded="no",
        note="transformers: recompute the non-persistent buffers _init_weights left unwritten from a "
             "config rebuild with parameters on meta",
    ),
)
