"""transformers' own ``infer_auto_device_map`` and ``from_pretrained``'s device-map step, made aware of
regex-declared tied weights (DiffusionGemma ties its encoder's whole text stack to the decoder).

Upstream, with ``all_tied_weights_keys`` expanded from regex patterns:

* ``compute_module_sizes`` skips tied targets by name, but on an already-tied model the target is the
  name ``named_parameters`` yields first, so the whole tied stack is counted as 0 bytes (budgets are
  overrun); on 5.11-5.12 ``get_module_size_with_ties`` instead adds the tied module once per tied
  parameter, nothing fits and the map is ``{"": "disk"}``, which ``from_pretrained`` never dispatches
  (every weight stays on meta);
* in every release up to the latest, ``get_module_size_with_ties`` raises ``IndexError`` once a
  tied member was placed before its group's source (small budgets);
* an explicit map that puts a tied target and its source on different devices fails in dispatch
  (``weight is on the meta device``).

The fix keeps upstream's own map where it is right (5.13+: every group on one device, every budget
kept, tied tensors counted once); otherwise it runs upstream's allocator on the tie-free problem
(each group counted once, at its source), then moves tied copies to their source's device within the
budgets (metapatch._offload.tied_placement). An explicit map that splits a group is repaired the same way, with a
warning naming the pairs. Where ``from_pretrained`` cannot use a map that is all disk (transformers
5.0-5.12 never dispatch it; 5.13+ with accelerate < 1.15 get accelerate's "offload the whole model to
the disk"), one small module with no tie crossing it is kept on cpu (within the cpu budget), for tied
and untied models alike.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, Optional

from .._framework.calls import call_arguments
from .._framework.records import Patch, Target, Upstream

PATCH_ID = "tied-device-map-transformers"

def _tensor_bytes(model: Any, hf_quantizer: Any, parameters: Optional[Dict[str, Any]] = None):
    def size(name: str) -> int:
        param = parameters[name] if parameters else model.get_parameter(name)
        element = hf_quantizer.param_element_size(model, name, param) if hf_quantizer is not None \
            else param.element_size()
        return int(param.numel() * element)
    return size


def _infer_auto_device_map(wrapped, instance, args, kwargs):
    from .._offload.tied_maps import clone_with_globals, sources_come_first, upstream_map_if_sound
    from .._offload.tied_members import dedupe_tied_sizes, tied_groups
    from .._offload.tied_placement import Placement

    call = call_arguments(wrapped, args, kwargs)
    model = call["model"]
    parameters: Dict[str, Any] = {}
    groups = tied_groups(model, extra=[g for g in (call.get("tied_parameters") or ()) if g], parameters=parameters)
    if not groups:
        return wrapped(*args, **kwargs)

    upstream = wrapped.__globals__
    if _upstream_counts_each_tie_once() and sources_come_first(groups, parameters):
        # Keep upstream's own map wherever it is right; it only needs replacing when it fails.
        device_map = upstream_map_if_sound(wrapped, args, kwargs, call.get("max_memory"), model, groups)
        if device_map is not None:
            return device_map

    seen: Dict[str, Any] = {}

    def compute_module_sizes(module, hf_quantizer=None, buffers_only=False, only_modules=True):
        all_sizes, leaves = upstream["compute_module_sizes"](
            module, hf_quantizer, buffers_only=buffers_only, only_modules=only_modules)
        if module is model and not buffers_only and not only_modules:
            dedupe_tied_sizes(all_sizes, groups, _tensor_bytes(model, hf_quantizer, parameters))
            seen["sizes"] = all_sizes
        return all_sizes, leaves

    def get_max_memory(max_memory=None):
        seen["budgets"] = budgets = upstream["get_max_memory"](max_memory)
        return budgets

    tie_free = clone_with_globals(
        wrapped, {"compute_module_sizes": compute_module_sizes, "get_max_memory": get_max_memory},
        also_clone=("_init_infer_auto_device_map",))
    clean = call.get("clean_result", True)
    call.update(tied_parameters=[[]], clean_result=False)
    raw = tie_free(**call)

    budgets = seen["budgets"]
    placement = Placement(model, raw, groups, sizes=seen["sizes"], budgets=budgets,
                             devices=list(budgets) + ["disk"],
                             no_split=call.get("no_split_module_classes") or (), parameter_names=parameters)
    device_map = upstream["OrderedDict"](placement.repair())
    if clean and call.get("no_placement_params") is None:
        device_map = upstream["clean_device_map"](device_map)
    return device_map


def _upstream_counts_each_tie_once() -> bool:
    """transformers 5.11-5.12 add a tied module's size once per tied parameter (fixed in 5.13 by
    PR #46625): their own map is then too pessimistic to keep even when it is valid."""
    return _transformers_at_least("5.13.0.dev0")


@lru_cache(maxsize=None)
def _at_least(distribution: str, version: str) -> bool:
    # cached: reading a distribution's metadata costs more than a small model's whole map inference
    import importlib.metadata

    from packaging.version import Version

    return Version(importlib.metadata.version(distribution)) >= Version(version)


def _transformers_at_least(version: str) -> bool:
    return _at_least("transformers", version)


def _single_disk_maps_are_dispatched() -> bool:
    """Whether ``from_pretrained`` can use a map that offloads everything to disk. transformers 5.0-5.12
    dispatch only maps naming more than one device, so such a map leaves every weight on meta
    (``Tensor.item() cannot be called on meta tensors``); 5.13+ hand it to accelerate, which before
    1.15 refuses it ("You are trying to offload the whole model to the disk"). Neither is about ties:
    the work-around below applies to every model."""
    return _transformers_at_least("5.13.0.dev0") and _at_least("accelerate", "1.15.0.dev0")


def _keep_one_module_on_cpu(model: Any, device_map: Dict[str, Any], groups, max_memory) -> Dict[str, Any]:
    """Put the smallest module that holds no part of a tied group spanning it on cpu, within the cpu
    budget, so that the (otherwise all-disk) map names two devices and is dispatched with offload hooks
    (see _single_disk_maps_are_dispatched). Untied models too: the map is all disk whenever the cpu
    budget is smaller than the largest layer."""
    from .._offload.tied_members import dedupe_tied_sizes
    from .._offload.tied_placement import Placement, entry_of

    sizes, get_max_memory = _module_sizes_and_budgets(model)
    dedupe_tied_sizes(sizes, groups, _tensor_bytes(model, None))
    cpu_budget = get_max_memory(dict(max_memory) if max_memory else None).get("cpu", 0)
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    members = {m for g in groups for m in g}
    best = None
    for name, module in model.named_modules():
        if not name:
            continue
        size = sizes.get(name, 0)
        if size > cpu_budget or (best is not None and size >= best[1]):
            continue
        inside = {m for m in members if m.startswith(name + ".")}
        if any(any(m not in inside for m in g) for g in groups if inside.intersection(g)):
            continue
        if any(parent and type(model.get_submodule(parent)).__name__ in no_split
               for parent in _parents(name)):
            continue
        best = (name, size)
    if best is None:
        return device_map
    placement = Placement(model, device_map, groups)
    while entry_of(placement.map, best[0]) != best[0]:
        if not placement._split(entry_of(placement.map, best[0])):
            return device_map
    placement.map[best[0]] = "cpu"
    return placement.map


def _parents(name: str):
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def _module_sizes_and_budgets(model: Any):
    """(sizes per module and tensor, get_max_memory) from transformers' own helpers (5.x), or from
    accelerate's, which transformers 4.57 uses (see tied_device_map_transformers_v4)."""
    import transformers.integrations.accelerate as integration

    if hasattr(integration, "compute_module_sizes"):
        sizes, _ = integration.compute_module_sizes(model, only_modules=False)
        return sizes, integration.get_max_memory
    from accelerate.utils import compute_module_sizes, get_max_memory

    return dict(compute_module_sizes(model)), get_max_memory


def _get_device_map(wrapped, instance, args, kwargs):
    from .._offload.tied_maps import speed_order
    from .._offload.tied_members import tied_groups
    from .._offload.tied_placement import Placement, warn_split_groups

    call = call_arguments(wrapped, args, kwargs)
    requested = call.get("device_map")
    device_map = wrapped(*args, **kwargs)
    if not isinstance(device_map, dict) or not device_map:
        return device_map
    model = call["model"]
    groups = tied_groups(model)
    if groups and isinstance(requested, dict):
        placement = Placement(model, device_map, groups, devices=speed_order(device_map.values()))
        repaired = placement.repair()
        if placement.moves:
            warn_split_groups(placement.moves)
            device_map = type(device_map)(repaired) if isinstance(device_map, dict) else repaired
    if set(device_map.values()) == {"disk"} and not _single_disk_maps_are_dispatched():
        device_map = _keep_one_module_on_cpu(model, dict(device_map), groups, call.get("max_memory"))
    return device_map


PATCH = Patch(
    id=PATCH_ID,
    title="transformers device maps keep regex-tied weight groups together, counted once (no IndexError, no all-meta model)",
    # Measured on 5.0.0, 5.3.0, 5.9.0, 5.11.0, 5.12.1, 5.13.1, 5.15.1, 5.17.0, 5.19.0, 5.21.1, 5.23.0, 5.24.0:
    # an explicit map splitting a tied pair fails (KeyError 'lm_head.weight') on every one of them; all-disk
    # maps fail on 5.0-5.12 (never dispatched) and on 5.13+ with accelerate < 1.15. 4.57 has the same bugs
    # in other functions: tied-device-map-transformers-v4.
    affects={"transformers": ">=5.0.0.dev0"},
    targets=(
        Target(
            "transformers.integrations.accelerate", "infer_auto_device_map",
            fingerprints=(
                "a5e99b9519762019",  # 5.0.0
                "8529e05005ef1f07",  # 5.1.0 - 5.12.1
                "e804e81215535018",  # 5.13.0 - 5.15.1 (PR #46625: each tie counted once)
                "410aabe65e7ad7f3",  # 5.16.0 - 5.17.0 (no_placement_params)
                "add8de969f996cfa",  # 5.18.0 - 5.21.1
                "33c8ba8a0dd83ecb",  # 5.22.0 - 5.24.0
            ),
            wrapper=_infer_auto_device_map,
        ),
        Target(
            "transformers.integrations.accelerate", "_get_device_map",
            fingerprints=(
                "dbfa0998d15666fc",  # 5.0.0
                "46a71bf0ab32ae95",  # 5.1.0 - 5.3.0
                "d40b215dfa0ac8a9",  # 5.4.0 - 5.15.1
                "ab58b0e9c44d01e1",  # 5.16.0 - 5.21.1
                "6dc74bd79a7ab756",  # 5.22.0 - 5.24.0
            ),
            wrapper=_get_device_map,
            aliases=("transformers.modeling_utils:_get_device_map",),
        ),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/pull/46625",),
        forwarded="no",
        note="PR #46625 (5.13.0) fixed the over-count for 2 GPUs and dispatches all-disk maps (which accelerate "
             "< 1.15 then refuses); the IndexError at small budgets, the zero-byte count of an already-tied "
             "stack and explicit maps that split a tied group remain in 5.24.0.",
    ),
    diagnoses=("tied-split", "no-hf-device-map"),  # metapatch.diagnose findings this fixes
)
