"""accelerate-redispatch-guard: ``dispatch_model``, ``cpu_offload`` and ``disk_offload`` over a model whose weights
accelerate already offloads refuse with an error that says so, before anything is changed.

A model loaded with ``from_pretrained(device_map=..., offload_folder=...)`` (or dispatched before) keeps each
offloaded weight as a meta placeholder; its value lives behind the module's offload hook. accelerate's
placement entry points take the values to place from ``model.state_dict()``: ``cpu_offload`` copies every
entry to the CPU, ``disk_offload`` and ``dispatch_model``'s disk entries write them to the offload folder,
and ``dispatch_model``'s device entries move each module. Over placeholders all of them fail with torch's
``NotImplementedError: Cannot copy out of meta tensor; no data!`` (accelerate#2129), some after half the
work: hooks already replaced, a new offload folder half written. Loading the model again with the placement
wanted is the working path (every release in the window; a re-dispatch that reads the old hooks'
stores would hold the offloaded weights in memory at once, the memory the offload was for).

The guard raises :class:`RedispatchOffloadedError` (a ``MetapatchError`` and a ``NotImplementedError``, like
``offloaded-move-guard``'s) where upstream would have to read a placeholder's value from ``model.state_dict()``:
the model holds a placeholder that an offload hook serves, and the call brings no source of its own (a
``state_dict``, an ``offload_index``, an ``offload_dir`` that already holds an ``index.json``). Everything
else calls upstream untouched: a model with nothing offloaded (``from_pretrained``'s own dispatch), a
one-device map (``model.to``, where ``offloaded-move-guard`` and ``offloaded-dtype-conversion`` decide),
PEFT's and transformers' re-dispatches (metapatch removes the hooks first, or passes the index).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from metapatch._framework.calls import signature_of
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream
from metapatch._offload.hook_state import offload_hook, served_placeholders, storage
from metapatch._offload.module_walk import named_modules
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "accelerate-redispatch-guard"


class RedispatchOffloadedError(MetapatchError, NotImplementedError):
    """Placing a model again whose weights accelerate offloaded. A NotImplementedError too, so code that caught
    torch's "Cannot copy out of meta tensor" still catches this one."""


def _offloaded(model: Any) -> List[Tuple[str, str]]:
    """``(key, "disk" or "cpu")`` for each meta placeholder an offload hook serves, in module order (the key its
    weights map stores it under: the checkpoint name where accelerate's ``PrefixedDataset`` gives one)."""
    found: List[Tuple[str, str]] = []
    for _, module in named_modules(model):
        hook = offload_hook(module)
        if hook is not None:
            found.extend((key, storage(hook)) for key, _ in served_placeholders(module))
    return found


def _has_index(folder: Optional[Any]) -> bool:
    return folder is not None and os.path.isfile(os.path.join(str(folder), "index.json"))


def _refuse(what: str, placeholders: List[Tuple[str, str]]) -> None:
    name, where = placeholders[0]
    raise RedispatchOffloadedError(
        f"metapatch: {what}() over a model whose weights accelerate already offloads ({len(placeholders)} tensors, "
        f"e.g. {name} on {where}): their values live behind the offload hooks, and {what} would read meta "
        f"placeholders from model.state_dict(). Nothing was changed. Load the model again with the placement you "
        f"want (from_pretrained(..., device_map=..., offload_folder=...)) or place the model before offloading it."
        f"\n(raised by metapatch patch {PATCH_ID!r}, METAPATCH_DISABLE={PATCH_ID} turns it off)")


def _guarded(what: str, sourced: Callable[[Dict[str, Any]], bool]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        arguments = signature_of(wrapped).bind_partial(*args, **kwargs).arguments
        model = arguments.get("model")
        if model is None or sourced(arguments):
            return wrapped(*args, **kwargs)
        placeholders = _offloaded(model)
        if placeholders:
            _refuse(what, placeholders)
        return wrapped(*args, **kwargs)

    return wrapper


def _dispatch_sourced(arguments: Dict[str, Any]) -> bool:
    device_map = arguments.get("device_map") or {}
    one_device = len(set(device_map.values())) == 1 and "disk" not in device_map.values()
    return (one_device or arguments.get("state_dict") is not None or arguments.get("offload_index") is not None
            or _has_index(arguments.get("offload_dir")))


PATCH = Patch(
    id=PATCH_ID,
    title="dispatch_model, cpu_offload and disk_offload over a model whose weights accelerate already offloads "
          "refuse with a clear error, before anything is changed, instead of Cannot copy out of meta tensor",
    # Measured: accelerate 1.10.0 - 1.16.0, NotImplementedError "Cannot copy out of meta tensor" from each entry
    # point over a tiny Llama loaded with layers on disk (accelerate#2129 is open since 0.25).
    affects={"accelerate": ">=1.10.0"},
    targets=(
        Target("accelerate.big_modeling", "dispatch_model",
               fingerprints=shared_fingerprints("accelerate.big_modeling:dispatch_model"),
               wrapper=_guarded("dispatch_model", _dispatch_sourced), aliases=("accelerate:dispatch_model",)),
        Target("accelerate.big_modeling", "cpu_offload", fingerprints=("6b7546e560cabdf6",),  # accelerate 1.10.0 - 1.16.0
               wrapper=_guarded("cpu_offload", lambda arguments: arguments.get("state_dict") is not None),
               aliases=("accelerate:cpu_offload",)),
        Target("accelerate.big_modeling", "disk_offload", fingerprints=("41773a0e20e682a0",),  # accelerate 1.10.0 - 1.16.0
               wrapper=_guarded("disk_offload", lambda arguments: _has_index(arguments.get("offload_dir"))),
               aliases=("accelerate:disk_offload",)),
    ),
    # The outermost wrapper of dispatch_model: it refuses before the others read or change anything.
    wraps_over=("accelerate-dispatch-skip-keys", "accelerate-unindexed-disk-tensors"),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues/2129",),
        forwarded="no",
        note="accelerate: dispatch_model, cpu_offload and disk_offload refuse an already offloaded model by name",
    ),
)
