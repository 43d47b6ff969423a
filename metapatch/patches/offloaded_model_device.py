"""offloaded-model-device: ``model.device`` names the device where an offloaded first parameter is used,
not ``meta``.

transformers' ``ModuleUtilsMixin.device`` (inherited by every ``PreTrainedModel``) is the device of the
model's first parameter. When accelerate offloads that parameter (``model.embed_tokens`` on disk, or
cpu-offloaded on a GPU machine), it is a meta placeholder between forward passes, so ``model.device``
says ``meta``. The common idiom ``inputs = tok(...).to(model.device)`` then sends the prompt to meta and
``generate()`` dies with ``Tensor.item() cannot be called on meta tensors`` in ``_prepare_special_tokens``
(QwenLM/Qwen2.5-Omni#110, huggingface/diffusers#13096).

The choice: ``model.device`` means "where to put the inputs"; that is how transformers itself uses it
(``generate``, attention masks) and how users use it. For an offloaded first parameter that place is
the execution device of its accelerate offload hook: the device the hook loads the weight onto for
each forward pass, which is where the computation with the inputs happens (the GPU for cpu/disk
offload on a GPU machine; cpu on a machine without accelerators). So the answer changes only when
upstream's answer is ``meta`` AND an accelerate offload hook governs that parameter. Everything else
keeps upstream's meaning: in-memory and dispatched-but-not-offloaded models (their first parameter is
not on meta), and a genuinely meta model, e.g. built under ``init_empty_weights`` (no hook: it still
says ``meta``, which code relies on to detect an unmaterialised model).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from .._offload.hook_state import execution_device, offload_hooks
from .._framework.records import Patch, Target, Upstream

PATCH_ID = "offloaded-model-device"


def _hook_execution_device(model: Any, name: str) -> Optional[Any]:
    """The execution device of the accelerate offload hook that loads parameter ``name``, or None."""
    owner_path = name.split(".")[:-1]
    # accelerate hooks the module that owns the parameter (attach_align_device_hook) or, with
    # place_submodules, one of its ancestors; the nearest one is the one that loads it.
    for depth in range(len(owner_path), -1, -1):
        module = model.get_submodule(".".join(owner_path[:depth]))
        for hook in offload_hooks(module):
            device = execution_device(hook)  # an int is an accelerator index, as for .to()
            if device is None:
                continue
            if depth == len(owner_path) or getattr(hook, "place_submodules", False):
                return device
    return None


def offload_execution_device(model: Any) -> Optional[Any]:
    """The execution device of the accelerate offload hook that loads ``model``'s first parameter, when
    that parameter is a meta placeholder; None when no hook fills it (a genuinely meta model)."""
    hooks_module = sys.modules.get("accelerate.hooks")
    if hooks_module is None:  # no accelerate imported: nothing can have been dispatched
        return None
    parameters = model.named_parameters()
    first = next(parameters, None)
    if first is None or not first[1].is_meta:
        return None
    found = _hook_execution_device(model, first[0])
    if found is not None or not getattr(model, "hf_device_map", None):
        return found
    # A dispatched model whose first parameter no hook loads: a tied copy's source that accelerate
    # loads under the copy's name (CamembertForCausalLM builds lm_head first; its lm_head.bias is
    # the source of lm_head.decoder.bias, loaded by the decoder's hook). The inputs go where the
    # first parameter that has a place is used.
    for name, param in parameters:
        if not param.is_meta:
            return param.device
        found = _hook_execution_device(model, name)
        if found is not None:
            return found
    return None


class _DeviceProperty(property):
    """A property subclass only so that the registry can mark it (plain properties take no attributes)."""


def _device_property(original: property) -> property:
    upstream_fget = original.fget

    def device(self: Any) -> Any:
        answer = upstream_fget(self)
        if answer.type != "meta":  # the common case costs one comparison
            return answer
        execution = offload_execution_device(self)
        return answer if execution is None else execution

    device.__doc__ = upstream_fget.__doc__
    return _DeviceProperty(device, original.fset, original.fdel, original.__doc__)


PATCH = Patch(
    id=PATCH_ID,
    title="model.device of a model whose first parameter is offloaded is the offload hook's execution device, not meta",
    # Measured (selftest generate-embedding-on-disk, unpatched: RuntimeError "Tensor.item() cannot be
    # called on meta tensors"): transformers 5.11.0, 5.17.0, 5.24.0, and the property is one source in
    # every 5.x release. No release answers otherwise, so the range stays open. 4.57 (a different
    # source, get_parameter_device) is offloaded-model-device-v4.
    affects={"transformers": ">=5.0.0.dev0"},
    targets=(
        Target("transformers.modeling_utils", "ModuleUtilsMixin.device",
               fingerprints=(
                   "ca0e9038ee90bc21",  # 5.0.0 - 5.6.2: next(param.device for param in self.parameters())
                   "90d98bce9f5141b4",  # 5.7.0 - 5.24.0: the same, with `self: "PreTrainedModel"` annotated
               ),
               replacement=_device_property),
    ),
    upstream=Upstream(
        bug=("https://github.com/QwenLM/Qwen2.5-Omni/issues/110", "https://github.com/huggingface/diffusers/issues/13096"),
        forwarded="no",
        note="upstream fix: ModuleUtilsMixin.device asks the first parameter's accelerate offload hook for its "
             "execution device when the parameter is a meta placeholder",
    ),
    diagnoses=("model-device-meta",),  # metapatch.diagnose findings this fixes
)
