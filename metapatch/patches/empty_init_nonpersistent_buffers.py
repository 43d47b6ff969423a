"""empty-init-nonpersistent-buffers: a model built with ``init_empty_weights(include_buffers=True)``
(or ``init_on_device(..., include_buffers=True)``) gets its non-persistent buffers back when its
checkpoint is loaded, instead of keeping them on meta (``load_checkpoint_and_dispatch``: ``inv_freq is
on the meta device, we need a `value```) or holding the uninitialised memory of ``to_empty()``
(silently wrong logits).

Under ``include_buffers=True`` every buffer is computed on meta, and a non-persistent buffer (rotary
``inv_freq``, position ids, masks) is never in a checkpoint: nothing in accelerate can give it a value.
Three wrappers:
- ``init_on_device`` (so ``init_empty_weights``, either ``include_buffers``) records the constructor
  arguments of each module built inside it (``metapatch._offload.buffer_rebuild.capture_constructors``);
- ``Module.to_empty`` on such a model (or on a transformers model built under ``torch.device("meta")``,
  whose config rebuilds them) gives the non-persistent buffers it replaced with uninitialised
  memory their constructor's value at once (with ``include_buffers=False`` they held their real value
  until then, huggingface/transformers#34234; a model then loaded with torch's own ``load_state_dict``
  never passes through accelerate); one that cannot be recomputed is recorded (tensor and ``_version``);
- ``load_checkpoint_in_model`` (so ``load_checkpoint_and_dispatch`` too) on such a model refills, after
  loading, each non-persistent buffer still on meta or still an unwritten recorded ``to_empty`` tensor,
  with the value of its module's constructor run again with parameters on meta; one that cannot be
  recomputed raises ``MetapatchError`` naming it.
A model not built under ``init_empty_weights`` / ``init_on_device`` (nothing recorded) calls upstream
untouched, and so does a load that leaves no buffer on meta or unwritten after ``to_empty``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "empty-init-nonpersistent-buffers"
_EMPTIED: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _init_on_device(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # Both modes: include_buffers=True leaves the buffers on meta; with False they are real until a
    # to_empty() (the usual next step) replaces them with uninitialised memory (transformers#34234).
    return _capturing(wrapped(*args, **kwargs))


@contextlib.contextmanager
def _capturing(inner: Any) -> Iterator[Any]:
    from metapatch._offload.buffer_rebuild import capture_constructors

    with inner as value, capture_constructors():
        yield value


def _built_empty(module: Any) -> bool:
    from metapatch._offload.buffer_rebuild import CONSTRUCTED

    return module in CONSTRUCTED


def _meta_non_persistent(model: Any) -> bool:
    """Whether a non-persistent buffer of ``model`` is on meta (it was built on the meta device)."""
    from metapatch._offload.module_walk import modules

    return any(module._buffers.get(name) is not None and module._buffers[name].is_meta
               for module in modules(model) for name in module._non_persistent_buffers_set)


def _to_empty(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if instance is None:
        return wrapped(*args, **kwargs)
    if not _built_empty(instance):
        # Built under ``torch.device("meta")`` (FSDP2 meta init, torchtitan, transformers#45902): no
        # constructor was recorded; a transformers model's config rebuilds the values. What it cannot
        # recompute is left to the caller, as torch leaves it.
        if not _meta_non_persistent(instance):
            return wrapped(*args, **kwargs)
        from metapatch._offload.buffer_rebuild import real_values, record, refill, restore

        pending = record(instance, only_meta=True)
        held = real_values(instance)
        result = wrapped(*args, **kwargs)
        restore(held)
        emptied = [(q, owner, name, owner._buffers[name], owner._buffers[name]._version)
                   for q, owner, name, _, _ in pending if owner._buffers.get(name) is not None]
        try:
            refill(instance, emptied, "a model built on the meta device and to_empty")
        except MetapatchError:
            pass
        return result
    from metapatch._offload.buffer_rebuild import real_values, record, refill, restore, unset

    # A buffer that held a real value (init_empty_weights() keeps buffers real by default) keeps that value,
    # which may differ from its constructor's (a temperature or a scale set after construction); only those
    # that were on meta have no value but their constructor's.
    was_meta = {id(p[3]) for p in record(instance, only_meta=True)}
    pending = [p for p in record(instance) if id(p[3]) in was_meta]
    held = real_values(instance)
    result = wrapped(*args, **kwargs)
    restore(held)
    emptied = [(q, owner, name, owner._buffers[name], owner._buffers[name]._version)
               for q, owner, name, _, _ in pending
               if owner._buffers.get(name) is not None and not owner._buffers[name].is_meta]
    if emptied:
        # Refilled now, not at a later load_checkpoint_in_model: no checkpoint holds them, and the model may
        # be loaded with torch's own load_state_dict (the meta-init + to_empty flow of FSDP2 and torchtitan),
        # which metapatch does not see. What cannot be recomputed stays recorded: a later
        # load_checkpoint_in_model refuses it by name; to_empty itself never raises for it.
        try:
            refill(instance, emptied, "init_empty_weights and to_empty")
        except MetapatchError:
            _EMPTIED.setdefault(instance, []).extend(unset(emptied))
    return result


def _load_checkpoint_in_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    model = bound.arguments.get("model")
    if model is None or not (_built_empty(model) or model in _EMPTIED):
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    from metapatch._offload.buffer_rebuild import record, refill

    pending = [*_EMPTIED.pop(model, []), *record(model, only_meta=True)]
    # a buffer still on meta goes where the map puts it (the in-memory model holds it with its module: {"": 0} is GPU 0)
    refill(model, pending, "init_empty_weights and load_checkpoint_in_model", bound.arguments.get("device_map"))
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="init_empty_weights (+ to_empty) + load_checkpoint_in_model / load_checkpoint_and_dispatch: "
          "non-persistent buffers get their constructor's value (not meta, not to_empty memory)",
    # Measured: accelerate 1.15.0 (transformers 5.24.0), 1.14.0 (5.17.0), 1.10.0 (4.57.1): meta -> ValueError
    # "we need a `value`" / NotImplementedError "Cannot copy out of meta tensor"; to_empty -> garbage. No
    # release records constructor values, so the range stays open.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        Target("accelerate.big_modeling", "init_on_device",
               fingerprints=("8f64bd510baf9d2f",  # accelerate 1.10.0 - 1.10.1
                             "ffd94284b6fb529c",  # accelerate 1.11.0 - 1.12.0
                             "dcbb5bea19947c22"),  # accelerate 1.13.0 - 1.15.0
               wrapper=_init_on_device, aliases=("accelerate:init_on_device",)),
        Target("torch.nn.modules.module", "Module.to_empty",
               fingerprints=("b7b5b22579c68e11", "d558d18541a90006", "621cbc22b7052a8d"),  # torch 2.5-2.7, 2.8-2.9,
               # 2.10-2.15 (read from every release's wheel): annotations and line breaks only
               wrapper=_to_empty),
        Target("accelerate.utils.modeling", "load_checkpoint_in_model",
               fingerprints=shared_fingerprints("accelerate.utils.modeling:load_checkpoint_in_model"),
               wrapper=_load_checkpoint_in_model,
               aliases=("accelerate:load_checkpoint_in_model", "accelerate.utils:load_checkpoint_in_model",
                        "accelerate.big_modeling:load_checkpoint_in_model")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/issues/34234",
             "https://github.com/huggingface/transformers/issues/48892"),
        forwarded="no",
        note="accelerate: init_on_device(include_buffers=True) records module constructor calls; "
             "load_checkpoint_in_model recomputes the non-persistent buffers still on meta from them",
    ),
)
