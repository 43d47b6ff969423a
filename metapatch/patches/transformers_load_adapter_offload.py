"""transformers-load-adapter-offload: transformers' own ``model.load_adapter(path)`` (``PeftAdapterMixin``,
not PEFT's ``PeftModel``) over a base model whose layers accelerate offloaded to cpu/disk gives the results
of the in-memory model, keeps the base's placement and writes nothing.

Upstream (huggingface/transformers#33744), measured on transformers 4.57.6, 5.0.0, 5.4.0, 5.11.0, 5.13.0, 5.17.0, 5.24.0:

* transformers 5.x loads the adapter with ``_load_pretrained_model`` and the base's ``hf_device_map``: the
  LoRA tensors of a layer mapped to ``"disk"`` are treated as disk-offloaded weights, put into an offload
  index that ``load_adapter`` then throws away, and never loaded. Those adapter tensors keep whatever
  ``inject_adapter_in_model`` gave them: ``meta`` upstream (the logits become NaN), or the adapter's fresh
  initialisation with PEFT's placement fixed by ``peft-offload-redispatch`` (logits silently off by ~0.5);
* transformers 4.57 loads the adapter and then re-dispatches the model with a freshly inferred
  ``device_map="auto"``: on a machine where everything fits in memory that calls ``model.to`` and stops
  with ``RuntimeError: You can't move a model that has some modules offloaded to cpu or disk.``

Here, for a model with accelerate offload hooks:

* ``load_adapter`` runs with the ``"disk"`` entries of ``hf_device_map`` (and of the ``load_config`` that
  ``from_pretrained(adapter_dir, device_map=...)`` passes, which transformers 5.0-5.3 load with) read as
  ``"cpu"`` (the map is restored afterwards): adapter tensors are small and trainable, so they are loaded into memory like every
  other adapter tensor, and nothing is sent to an offload index or written anywhere;
* transformers 4.57's re-dispatch after loading is skipped: the base keeps its hooks and offload files
  (no weight is read or written again); an explicit ``device_map`` or ``max_memory`` passed to
  ``load_adapter`` there, a request for a new placement that cannot be honoured over weights that are
  already offloaded, is refused with a :class:`~metapatch._framework.records.MetapatchError` saying what to do;
* the load is one :class:`metapatch._offload.operations.Operation`: a tensor the adapter brings for an offloaded
  module (a saved embedding layer) is kept for that module's hook to serve (in CPU memory, nothing written),
  not dropped at its next forward;
* then the adapter tensors follow their base layer's offload hook (:mod:`metapatch._offload.adapter_offload`, the
  mechanism ``peft-offload-redispatch`` uses): placed on the hook's execution device, the base layer
  held for the tuner layer's whole forward, anything still on ``meta`` refused with a ``MetapatchError``.

``set_adapter``, ``enable_adapters``/``disable_adapters`` and ``from_pretrained(adapter_dir, device_map=...)``
(which calls ``load_adapter``) then work as on the in-memory model.
"""

from __future__ import annotations

import contextvars
from typing import Any

from metapatch._offload import operations
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream

PATCH_ID = "transformers-load-adapter-offload"
OFFLOADED_DEVICES = {"cpu", "disk"}

# Set while load_adapter runs over an offloaded model: transformers 4.57's re-dispatch is skipped then.
_KEEPING_PLACEMENT = contextvars.ContextVar("metapatch_load_adapter_keeps_placement", default=False)


def _is_offloaded(model: Any) -> bool:
    """Dispatched by accelerate with weights offloaded (an offload hook somewhere, a map naming cpu/disk).
    The map is read first: a model without one is left to upstream without a walk."""
    from metapatch._offload.hook_state import offload_hook

    device_map = getattr(model, "__dict__", {}).get("hf_device_map")
    if not isinstance(device_map, dict) or not OFFLOADED_DEVICES & set(map(str, device_map.values())):
        return False
    return any(offload_hook(module) is not None for module in model.modules())


def _adapter_loading_map(device_map: dict) -> dict:
    """The map ``load_adapter`` sees: "disk" read as "cpu", so adapter tensors of disk-offloaded layers
    are loaded into memory (their layer's hook then decides the execution device)."""
    return {name: ("cpu" if str(device) == "disk" else device) for name, device in device_map.items()}


def _with_adapter_loading_config(kwargs: dict) -> dict:
    """``from_pretrained(adapter_dir, device_map=...)`` hands its ``load_config`` (the user's map) to
    load_adapter; transformers 5.0-5.3 load the adapter with that map rather than ``hf_device_map``."""
    import dataclasses

    config = kwargs.get("load_config")
    device_map = getattr(config, "device_map", None)
    if not isinstance(device_map, dict) or not dataclasses.is_dataclass(config):
        return kwargs
    return dict(kwargs, load_config=dataclasses.replace(config, device_map=_adapter_loading_map(device_map)))


def _refuse_new_placement(wrapped: Any, args: tuple, kwargs: dict) -> None:
    """transformers 4.57's load_adapter takes ``device_map`` (default "auto") and ``max_memory`` to
    re-dispatch the whole model; over weights already offloaded that cannot be done safely."""
    import inspect

    try:
        bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return  # wrong arguments: upstream raises its own error
    device_map, max_memory = bound.get("device_map", "auto"), bound.get("max_memory")
    if device_map in (None, "auto") and max_memory is None:
        return
    raise MetapatchError(
        f"metapatch ({PATCH_ID}): load_adapter(device_map={device_map!r}, max_memory={max_memory!r}) asks for a "
        f"new placement of a model whose weights accelerate already offloaded to cpu/disk; transformers would "
        f"re-dispatch it from meta placeholders. The adapter follows the base model's current placement: call "
        f"load_adapter without device_map/max_memory, and choose the placement when loading the base model "
        f"(from_pretrained(..., device_map=..., max_memory=..., offload_folder=...)).")


def load_adapter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if instance is None or not _is_offloaded(instance):
        return wrapped(*args, **kwargs)
    from metapatch._offload.adapter_offload import follow_base_layer_hooks

    if "device_map" in _parameters(wrapped):  # transformers 4.x: load_adapter re-dispatches
        _refuse_new_placement(wrapped, args, kwargs)
    kwargs = _with_adapter_loading_config(kwargs)
    saved = instance.__dict__["hf_device_map"]
    instance.__dict__["hf_device_map"] = _adapter_loading_map(saved)
    token = _KEEPING_PLACEMENT.set(True)
    try:
        # One store operation: a tensor the adapter brings for an offloaded module (a saved embedding
        # layer; transformers 5 materialises it on cpu, 4.57's load_state_dict copies into meta) is kept
        # for that module's hook to serve instead of being dropped at its next forward.
        with operations.Operation("model.load_adapter") as operation:
            operation.watch_loads(instance)
            result = wrapped(*args, **kwargs)
            operation.adopt_materialised(instance)
    finally:
        _KEEPING_PLACEMENT.reset(token)
        instance.__dict__["hf_device_map"] = saved
    follow_base_layer_hooks(instance)
    return result


def _parameters(function: Any) -> tuple:
    import inspect

    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def dispatch_accelerate_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """transformers 4.57's re-dispatch at the end of load_adapter: skipped over an offloaded model (the
    base keeps its hooks; the adapter follows them); called through everywhere else."""
    if _KEEPING_PLACEMENT.get():
        return None
    return wrapped(*args, **kwargs)


_MODULE = "transformers.integrations.peft"

PATCH = Patch(
    id=PATCH_ID,
    title="transformers' model.load_adapter over a cpu/disk-offloaded base: the adapter's real weights for every "
          "layer (no meta/NaN, no dropped tensors), the base's placement kept, nothing written",
    # Measured: the reproducers fail unpatched on 4.57.6 (RuntimeError from the re-dispatch), 5.0.0 (only
    # from_pretrained(adapter_dir): 5.0-5.3 load a direct load_adapter without the base's map), 5.4.0, 5.11.0,
    # 5.13.0, 5.17.0 and 5.24.0 (NaN logits or the adapter's random initialisation: the adapter tensors of
    # disk layers are never loaded) and pass patched. Open above:
    # transformers main (checked 2026-11-30) still routes adapter keys through the disk offload index.
    affects={"transformers": ">=4.57.0", "peft": ">=0.17.0", "accelerate": ">=1.10.0"},
    targets=(
        Target(_MODULE, "PeftAdapterMixin.load_adapter",
               # measured: 4.57.6, 5.0.0, 5.4.0, 5.11.0, 5.13.0, 5.17.0, 5.24.0, 5.25.0; 5.1-5.3, 5.6 and 5.7-5.9 by
               # reading their code (the 5.0 / 5.4 load paths with unrelated changes): `survey --run` measures them
               fingerprints=("ebd599c0de0ac56b",  # 4.57.1-4.57.6
                             "eb11769c692ea7be",  # 5.0.0
                             "6383be1dfc0c9505",  # 5.1.0-5.3.0
                             "c68019f3512d2ad3",  # 5.4.0-5.5.4
                             "e9145ead2a90096d",  # 5.6.0-5.6.2
                             "5eaca26c41a8a192",  # 5.7.0-5.9.0
                             "36b4030936e7064a",  # 5.10.1-5.12.1
                             "e7466abfc0e476c7",  # 5.13.0-5.14.1
                             "beadb955f56f144d",  # 5.15.0-5.17.0
                             "137dc62b2b9760e7",  # 5.18.0-5.24.0
                             "6625c16c4dc703b9"),  # 5.25.0 (missing keys: a tied adapter tensor counts as loaded)
               wrapper=load_adapter),
        Target(_MODULE, "PeftAdapterMixin._dispatch_accelerate_model",
               fingerprints=("96b5fee0f12a7b53",  # 4.57.1-4.57.6
                             "39787627860f5c4e"),  # 5.0.0-5.24.0
               wrapper=dispatch_accelerate_model),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/issues/33744",),
        forwarded="no",
        note="transformers: load_adapter loads adapter tensors of disk-offloaded layers into memory instead of "
             "routing them to a discarded offload index (5.x) and keeps the base placement instead of "
             "re-dispatching from meta weights (4.57)",
    ),
)
