"""accelerate-unindexed-disk-tensors: ``dispatch_model(..., offload_index=...)`` serves, from memory, a
disk-mapped tensor that the model holds but the given offload index lacks, instead of dropping it.

Given an ``offload_index``, accelerate trusts it for every disk-mapped tensor: the offload hooks put each
of them on meta and look it up in the index at the first forward. transformers builds that index from
the checkpoint's keys, so a tensor the checkpoint never holds has no entry even though transformers
computed its value at load: MarianMT's sinusoidal ``embed_positions.weight`` (``_keys_to_ignore_on_save``)
on disk fails with ``KeyError: 'model.encoder.embed_positions.weight'``, and so does any other tensor that
is missing from the checkpoint and initialised by the model. The value is there until the hooks are
attached; this patch takes a reference to each such tensor before dispatch and, once the hooks exist,
keeps it in CPU memory in front of the owning hook's weights map (the offload folder is never written).
What is served is exactly what the in-memory model holds. Nothing happens where no disk-mapped tensor is
missing from the index (the call goes straight through, nothing is walked without a disk entry).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "accelerate-unindexed-disk-tensors"


def _under(name: str, roots: list) -> bool:
    return any(root == "" or name == root or name.startswith(root + ".") for root in roots)


def unindexed(model: Any, device_map: Any, offload_index: Any) -> Dict[str, Any]:
    """The model's tensors that ``device_map`` puts on disk, that hold a value (not meta) and that
    ``offload_index`` has no entry for, by qualified name (references, not copies)."""
    if not isinstance(offload_index, Mapping) or not isinstance(device_map, Mapping):
        return {}
    disk = [name for name, device in device_map.items() if device == "disk"]
    if not disk:
        return {}
    from accelerate.utils import named_module_tensors

    # The names the offload hooks look up (hook_tensors reads the same way), and no state_dict(): accelerate
    # makes none when given an index, and a module's own _save_to_state_dict (bitsandbytes' 4-bit layers)
    # would run on its meta tensors here.
    return {name: tensor for name, tensor in named_module_tensors(model, include_buffers=True, recurse=True,
                                                                  remove_non_persistent=True)
            if name not in offload_index and _under(name, disk) and not tensor.is_meta}


def serve(model: Any, values: Dict[str, Any]) -> list:
    """Keep each of ``values`` for the offload hook that now serves it from a map lacking it; returns the
    qualified names served."""
    from metapatch._offload.hook_state import holds, offload_hooks, weights_map_of
    from metapatch._offload.store import hook_tensors, keep

    served = []
    for prefix, module in model.named_modules():
        for hook in offload_hooks(module):
            weights_map = weights_map_of(hook)
            if weights_map is None:
                continue
            for name, tensor in hook_tensors(module, hook):
                qualified = f"{prefix}.{name}" if prefix else name
                if qualified in values and tensor.is_meta and not holds(weights_map, name):
                    keep(hook, name, values[qualified])
                    served.append(qualified)
    return served


def _dispatch_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    get = bound.arguments.get
    model = get("model")
    values = unindexed(model, get("device_map"), get("offload_index")) if model is not None else {}
    result = wrapped(*args, **kwargs)
    if values:
        serve(model, values)
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="dispatch_model serves a disk-mapped tensor that the model holds but its offload index lacks "
          "(MarianMT's never-saved sinusoidal table): no KeyError at forward",
    # Every release in the window trusts a given offload_index for every disk-mapped tensor; measured
    # (selftest never-saved-table-on-disk): KeyError on transformers 4.57.1 / accelerate 1.10.0, 5.2.0 /
    # 1.11.0, 5.7.0 / 1.13.0, 5.11.0 / 1.13.0, 5.24.0 / 1.15.0 and 5.25.0 / 1.16.0; new-head-from-base-checkpoint-on-disk (a
    # missing key initialised at load, any architecture): KeyError on 5.7.0 / 1.13.0, 5.11.0 / 1.13.0 and
    # 5.25.0 / 1.16.0.
    affects={"accelerate": ">=1.0"},
    targets=(
        Target("accelerate.big_modeling", "dispatch_model",
               fingerprints=shared_fingerprints("accelerate.big_modeling:dispatch_model"),
               wrapper=_dispatch_model, aliases=("accelerate:dispatch_model",)),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues?q=dispatch_model+offload_index+KeyError",
             "https://github.com/huggingface/transformers/issues?q=Marian+embed_positions+disk+KeyError"),
        forwarded="no",
        note="accelerate: dispatch_model keeps the disk-mapped tensors that a given offload_index lacks in "
             "the weights map's in-memory part; see the upstream diff",
    ),
    # Either order works (skip-keys only fills in an argument, this one reads the model before the call
    # and serves after it); outside, so the tensors are taken before any wrapper below runs.
    wraps_over=("accelerate-dispatch-skip-keys",),
)
