"""transformers-pipeline-offloaded-device: a pipeline over a model that accelerate dispatched with offloaded
weights computes on the dispatch's execution device, whatever entry its device map starts with.

``Pipeline.__init__`` (every task's pipeline, built by ``pipeline(task, model=..., device_map=...)`` or from a
model loaded with ``from_pretrained(device_map=...)``) takes its device from the model's ``hf_device_map``:
``device = next(iter(hf_device_map.values()))``, the placement of the map's first module. That placement
is where the module is stored, not necessarily where it computes:

* ``"disk"`` first (``{"": "disk"}``, or ``device_map="auto"`` with a ``max_memory`` too small for the
  embedding, or any explicit map that offloads the first module): ``torch.device("disk")`` raises
  ``RuntimeError: Expected one of cpu, cuda, ... device type at start of device string: disk``, so no
  pipeline can be built over the model at all;
* ``"cpu"`` first with a GPU later in the map: accelerate offloads the cpu entries and computes them on the
  GPU, but the pipeline sends every input to the CPU, and its results come back there.

accelerate computes every offloaded module of a dispatch on one device, ``dispatch_model``'s
``main_device`` (the map's first accelerator where it has one, else the CPU), and the hook it puts on the
model's root module moves the inputs there (``io_same_device``). That device is the pipeline's device:
this patch reads it from that root hook (:mod:`metapatch._offload.hook_state`, the one reader of hook
state) when the map's first entry is ``"disk"`` or ``"cpu"`` and the hook computes elsewhere, and runs
upstream's ``__init__`` with the map's first value read as that device. Upstream reads the map once, at
the top of ``__init__``, for that first value and for "was the model dispatched" checks (which stay true);
the map is the model's own again before ``__init__`` returns, also when it raises.

Left to upstream untouched: an explicit ``device=`` (upstream refuses it for a dispatched model), a model
without a map or not dispatched by accelerate (no root hook: a single-device map), and a map whose first
entry is an accelerator (where that module computes; upstream's answer) or already the execution device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Tuple

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream

PATCH_ID = "transformers-pipeline-offloaded-device"
STORAGE = ("cpu", "disk")  # map values that name where a module is stored, not (always) where it computes


def _map_owner(model: Any) -> Any:
    """The module whose own attribute ``hf_device_map`` is: the model itself, or the base model a wrapper
    (PEFT) forwards the attribute to."""
    from metapatch._offload.model_placement import device_map_owner

    prefix, _ = device_map_owner(model)
    return model.get_submodule(prefix)


def dispatch_execution_device(module: Any) -> Optional[Any]:
    """The execution device of the hook accelerate's ``dispatch_model`` put on ``module`` (the model it
    dispatched): ``main_device``, where every offloaded module computes. None where no such hook is there
    (a model placed on one device without hooks)."""
    from metapatch._offload.hook_state import align_hooks, execution_device

    for hook in align_hooks(module):
        device = execution_device(hook)
        if device is not None:
            return device
    return None


def _same_device(a: Any, b: Any) -> bool:
    import torch

    try:
        return torch.device(a) == torch.device(b)
    except (RuntimeError, TypeError, ValueError):  # "disk" is no torch device
        return False


def pipeline_device(model: Any) -> Tuple[Any, Optional[Mapping[str, Any]], Any]:
    """(the module holding the map, the map, the execution device the pipeline must use) where upstream's
    first-entry rule picks offload storage over it; (None, None, None) where upstream's answer stands."""
    device_map = getattr(model, "hf_device_map", None)  # what upstream reads (a wrapper forwards it)
    if not isinstance(device_map, Mapping) or not device_map:
        return None, None, None
    first = next(iter(device_map.values()))
    if str(first) not in STORAGE:
        return None, None, None
    owner = _map_owner(model)
    if getattr(owner, "__dict__", {}).get("hf_device_map") is not device_map:
        return None, None, None  # not an attribute this patch can show differently for the call and restore
    execution = dispatch_execution_device(owner)
    if execution is None or _same_device(first, execution):
        return None, None, None
    return owner, device_map, execution


def _init__(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    # the function, not the bound method: a signature cached per bound method would keep every pipeline alive
    function = getattr(wrapped, "__func__", None)
    if function is None:
        return wrapped(*args, **kwargs)
    bound = signature_of(function).bind_partial(instance, *args, **kwargs)
    model = bound.arguments.get("model")
    if model is None or bound.arguments.get("device") is not None:
        return wrapped(*args, **kwargs)
    owner, device_map, execution = pipeline_device(model)
    if owner is None:
        return wrapped(*args, **kwargs)
    first_key = next(iter(device_map))
    shown = dict(device_map)
    shown[first_key] = execution  # the same keys in the same order: only the first value upstream reads changes
    owner.__dict__["hf_device_map"] = shown
    try:
        return wrapped(*args, **kwargs)
    finally:
        owner.__dict__["hf_device_map"] = device_map


PATCH = Patch(
    id=PATCH_ID,
    title="a pipeline over a model whose device map starts with a disk (or offloaded cpu) entry computes on the "
          "dispatch's execution device instead of failing on torch.device('disk')",
    # Measured (selftest, unpatched: RuntimeError "... device type at start of device string: disk"):
    # transformers 5.11.0 (text-classification-mixed-map) and 5.25.0 (every disk-first scenario). Every release
    # of the window takes `next(iter(hf_device_map.values()))` and reads the map nowhere else in __init__ (read
    # in the six code variants of the survey table); the range stays open until a release has the fix.
    affects={"transformers": ">=4.57.0"},
    targets=(
        Target("transformers.pipelines.base", "Pipeline.__init__",
               fingerprints=(
                   "b5f2134c6793d615",  # 4.57.x: with `framework` and TF models
                   "c51bf3ef90125045",  # 5.0.0 - 5.10.4
                   "3abef9a0c4fa32cd",  # 5.11.0 - 5.14.1
                   "5ee524aaceba5be3",  # 5.15.x
                   "491ad6b0572e09d3",  # 5.16.0 - 5.19.0
                   "fdb300a43f84b1e6",  # 5.20.0 - 5.25.0
               ),
               wrapper=_init__),
    ),
    upstream=Upstream(
        bug=(),
        forwarded="no",
        note="upstream fix: Pipeline.__init__ takes the execution device of a dispatched model (the root "
             "module's accelerate hook) when the device map's first entry is cpu or disk storage",
    ),
)
