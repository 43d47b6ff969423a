"""offloaded-resize-token-embeddings: ``model.resize_token_embeddings(n)`` on a model whose input embedding
(and output head) accelerate offloaded to cpu/disk gives the in-memory model's resized weights.

Upstream (huggingface/transformers#25554), measured on transformers 4.57.6, 5.11.0 and 5.24.0: the
embedding's weight is a ``meta`` placeholder between forwards, so ``_get_resized_embeddings`` builds the
new weight on meta and copies meta rows into it; with mean resizing (the default) the covariance check
stops with ``RuntimeError: Tensor.item() cannot be called on meta tensors``; without it the resize
"succeeds", the old offload hook keeps serving the old ``[vocab, hidden]`` tensor, and the first forward
stops in ``set_module_tensor_to_device`` (``Trying to set a tensor of shape ...``). The old rows would be
lost either way: nothing ever read them.

Here, when the input or output embedding has its own accelerate offload hook:

* those modules are onloaded (their hooks load the real weights onto the execution device and stop
  offloading) for the whole of upstream's ``resize_token_embeddings``, which then resizes real tensors:
  the old rows copied, new rows initialised exactly as for an in-memory model (mean resizing included),
  a tied head re-tied by upstream's ``tie_weights``;
* then each resized module is offloaded again by the same hook (attached by upstream to a new head
  module too), whose weights map now serves the resized tensors, kept in CPU memory, in front of the old
  map. Nothing is written: the user's offload folder and checkpoint files keep the old weights unchanged
  (a resized embedding that was on disk lives in CPU memory afterwards; save the model to persist it).
  Tensors shared before re-offloading (a tied head) share one placeholder again afterwards.

A write into the embedding's ``meta`` placeholder after the resize
(``model.get_input_embeddings().weight.data[token_id] = learned``, textual inversion under
``accelerate.cpu_offload``) is kept by offloaded-placeholder-writes, which marks the placeholders this patch's
re-offload puts back.

An embedding offloaded only as part of a larger block (its weights in an ancestor's hook) is refused with
a :class:`~metapatch._framework.records.MetapatchError`: give the embedding and the head their own ``device_map``
entries (``"model.embed_tokens"``, ``"lm_head"``), as ``device_map="auto"`` does.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from metapatch._offload.hook_state import serve_from, weights_map_of
from metapatch._offload.store import Overlay
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream

PATCH_ID = "offloaded-resize-token-embeddings"


def _embedding_modules(model: Any) -> List[Any]:
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            module = None
        if module is not None and all(module is not m for m in found):
            found.append(module)
    return found


def _has_meta_tensors(module: Any) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _offloaded_embeddings(model: Any) -> List[Tuple[Any, Any]]:
    """(module, its offload hook) for the input/output embeddings that accelerate offloads; raises where an
    embedding is offloaded only through an ancestor's hook (its weights map is the whole block's)."""
    from metapatch._offload.hook_state import offload_hook

    offloaded = []
    for module in _embedding_modules(model):
        hook = offload_hook(module)
        if hook is not None:
            offloaded.append((module, hook))
        elif _has_meta_tensors(module):
            raise MetapatchError(
                f"metapatch ({PATCH_ID}): resize_token_embeddings on a model whose {type(module).__name__} "
                f"embedding is offloaded as part of a larger block (its weights are on the meta device and no hook "
                f"of its own loads them), so the old rows cannot be read and the new ones would not be served. "
                f"Give the embedding and the head their own device_map entries when loading (e.g. "
                f"device_map={{'model.embed_tokens': 'cpu', 'lm_head': 'cpu', ...}}, as device_map='auto' does), "
                f"or resize before dispatching the model.")
    return offloaded


def _onload(module: Any, hook: Any) -> Dict[str, Any]:
    """The module's real weights on the hook's execution device until :func:`_offload_again`."""
    original_devices = dict(getattr(hook, "original_devices", {}) or {})
    hook.pre_forward(module)
    hook.offload = False
    return original_devices


def _carries(module: Any, hook: Any) -> bool:
    """``hook`` is ``module``'s own (also inside a ``SequentialHook``). By identity, not through
    ``offload_hook``: that one only finds hooks with ``offload`` on, which :func:`_onload` has turned off."""
    from metapatch._offload.hook_state import hooks_on

    return any(h is hook for h in hooks_on(module))


def _current_module(model: Any, old: Any, hook: Any) -> Any:
    """Where ``hook`` hangs after the resize: the same module (embeddings are resized in place), or the new
    head upstream built and attached the same hook to (``add_hook_to_module(new_lm_head, hook)``)."""
    for module in _embedding_modules(model) + [old]:
        if _carries(module, hook):
            return module
    return None


def _maybe_offloaded(model: Any) -> bool:
    """Cheap, no walk and no call into the model: accelerate marks every model it dispatches or offloads
    (``hf_device_map`` from ``dispatch_model``/``from_pretrained(device_map=...)``, a ``_hf_hook`` on the
    model from ``cpu_offload``/``disk_offload``), and a block offloaded by hand carries its hook on the
    base model. A model with none of these (in memory, or on meta under ``init_empty_weights``) gets
    upstream untouched."""
    from metapatch._offload.hook_state import hooked

    attributes = getattr(model, "__dict__", {})
    if "hf_device_map" in attributes or hooked(model):
        return True
    base = attributes.get("_modules", {}).get(getattr(type(model), "base_model_prefix", None) or "")
    return base is not None and hooked(base)


def _tensors(module: Any, hook: Any) -> List[Tuple[str, Any]]:
    from accelerate.utils import named_module_tensors

    return list(named_module_tensors(module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules,
                                     remove_non_persistent=True))


def _offload_again(module: Any, hook: Any, original_devices: Dict[str, Any], cpu_copies: Dict[int, Any]) -> None:
    """Offload ``module`` by ``hook`` again, its weights map now serving the resized tensors. A tensor
    shared by several modules (a tied head) gets one CPU copy."""
    import torch

    resized = {}
    for name, tensor in _tensors(module, hook):
        if id(tensor) not in cpu_copies:
            cpu_copies[id(tensor)] = tensor.detach().to("cpu")
        resized[name] = cpu_copies[id(tensor)]
    # in front of the previous map, one layer per resize (the offload store's own overlay: what
    # hook_state reads, so diagnose and the move guard see the resized tensors in CPU memory)
    serve_from(hook, Overlay(weights_map_of(hook), resized))
    hook.original_devices = {name: original_devices.get(name, device)
                             for name, device in (getattr(hook, "original_devices", {}) or {}).items()}
    hook.offload = True
    hook.post_forward(module, torch.empty(0))


def _shared_tensors(modules: List[Any]) -> List[Tuple[Any, str, Any, str]]:
    """(module, name, other module, other name) for tensors held by two of ``modules`` (a tied head)."""
    owners: Dict[int, Tuple[Any, str]] = {}
    shared = []
    for module in modules:
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None:
                continue
            if id(tensor) in owners and owners[id(tensor)][0] is not module:
                shared.append((*owners[id(tensor)], module, name))
            else:
                owners.setdefault(id(tensor), (module, name))
    return shared


def _share_again(shared: List[Tuple[Any, str, Any, str]]) -> None:
    from metapatch._offload.placeholder_writes import record_tie

    for module, name, other, other_name in shared:
        if name in module._parameters:
            other._parameters[other_name] = module._parameters[name]
            record_tie(module, name, other, other_name)  # kept one object after forwards split them
        else:
            other._buffers[other_name] = module._buffers[name]


def _resize(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not _maybe_offloaded(instance):
        return wrapped(*args, **kwargs)
    offloaded = _offloaded_embeddings(instance)
    if not offloaded:
        return wrapped(*args, **kwargs)
    held = [(module, hook, _onload(module, hook)) for module, hook in offloaded]
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        for module, hook, original_devices in held:  # back as it was (upstream failed before replacing it)
            _offload_again(module, hook, original_devices, {})
        raise
    current = [(_current_module(instance, module, hook), hook, devices) for module, hook, devices in held]
    current = [(module, hook, devices) for module, hook, devices in current if module is not None]
    shared = _shared_tensors([module for module, _, _ in current])
    cpu_copies: Dict[int, Any] = {}
    for module, hook, original_devices in current:
        _offload_again(module, hook, original_devices, cpu_copies)
    _share_again(shared)
    return result


def resize_token_embeddings(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    new_num_tokens = args[0] if args else kwargs.get("new_num_tokens")
    pad_to_multiple_of = args[1] if len(args) > 1 else kwargs.get("pad_to_multiple_of")
    if instance is None or (new_num_tokens is None and pad_to_multiple_of is None):
        return wrapped(*args, **kwargs)  # upstream only returns the embedding then
    return _resize(wrapped, instance, args, kwargs)


PATCH = Patch(
    id=PATCH_ID,
    title="resize_token_embeddings on a model with an offloaded embedding/head: old rows kept, new rows as "
          "in memory (mean resizing included), tied head re-tied, nothing written to the offload files",
    # Measured: the reproducers fail unpatched on 4.57.6, 5.11.0 and 5.24.0 (RuntimeError with mean
    # resizing, ValueError at the first forward without) and pass patched. transformers main builds the new
    # weight on the old weight's device (meta) as every release does.
    affects={"transformers": ">=4.57.0", "accelerate": ">=1.10.0"},
    targets=(
        Target("transformers.modeling_utils", "PreTrainedModel.resize_token_embeddings",
               fingerprints=("524d9d4617b6bf4b",  # 4.57.1-4.57.6 (measured on 4.57.6)
                             "fd288250cc0bf79f"),  # 5.0.0-5.24.0 (measured on 5.11.0 and 5.24.0)
               wrapper=resize_token_embeddings),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/issues/25554",),
        forwarded="no",
        note="transformers: resize_token_embeddings onloads an offloaded embedding/head for the resize and "
             "re-offloads it with a weights map holding the resized tensors",
    ),
)
