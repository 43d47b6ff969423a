"""accelerate's ``infer_auto_device_map`` (what PEFT's re-dispatch and ``load_checkpoint_and_dispatch``
call) made aware of declared tied weights, regex-expanded by transformers.

Upstream finds ties by tensor identity only: on a meta model built before ``tie_weights`` it sees no
ties, counts every tied copy in full and may split a group across devices; on a tied DiffusionGemma
its ``get_module_size_with_ties`` raises ``IndexError`` once a tied member was placed before its
group's source. The fix is the one the transformers side uses (metapatch._offload.tied_placement): upstream's
allocator runs on the tie-free problem, each group counted once at its source, then the tied copies
join their source's device within the budgets. Where every group is already one tensor and upstream's
map is sound, upstream's map is returned unchanged (accelerate's own tests expect its exact maps).
"""

from __future__ import annotations

from typing import Any, Dict

from .._framework.calls import call_arguments
from .._framework.records import Patch, Target, Upstream

PATCH_ID = "tied-device-map-accelerate"

def _infer_auto_device_map(wrapped, instance, args, kwargs):
    from .._offload.tied_maps import all_tied_identically, clone_with_globals, sources_come_first, upstream_map_if_sound
    from .._offload.tied_members import dedupe_tied_sizes, tied_groups
    from .._offload.tied_placement import Placement

    call = call_arguments(wrapped, args, kwargs)
    model = call["model"]
    parameters: Dict[str, Any] = {}
    groups = tied_groups(model, parameters=parameters)
    if not groups:
        return wrapped(*args, **kwargs)

    upstream = wrapped.__globals__
    if all_tied_identically(model, groups, parameters) and sources_come_first(groups, parameters):
        # Upstream sees these ties; keep its map wherever it is right.
        device_map = upstream_map_if_sound(wrapped, args, kwargs, call.get("max_memory"), model, groups)
        if device_map is not None:
            return device_map
    seen: Dict[str, Any] = {}

    def compute_module_sizes(module, dtype=None, special_dtypes=None, buffers_only=False):
        sizes = upstream["compute_module_sizes"](module, dtype=dtype, special_dtypes=special_dtypes,
                                                 buffers_only=buffers_only)
        if module is model and not buffers_only:
            def tensor_bytes(name: str) -> int:
                param = model.get_parameter(name)
                return int(param.numel() * param.element_size())
            dedupe_tied_sizes(sizes, groups, tensor_bytes)
            seen["sizes"] = sizes
        return sizes

    def get_max_memory(max_memory=None):
        seen["budgets"] = budgets = upstream["get_max_memory"](max_memory)
        return budgets

    tie_free = clone_with_globals(wrapped, {
        "compute_module_sizes": compute_module_sizes,
        "get_max_memory": get_max_memory,
        # The groups are handled after allocation; upstream must neither see nor warn about them.
        "find_tied_parameters": lambda *a, **k: [],
        "check_tied_parameters_in_config": lambda *a, **k: False,
    }, also_clone=("_init_infer_auto_device_map",))
    clean = call.get("clean_result", True)
    call["clean_result"] = False
    raw = tie_free(**call)

    budgets = seen["budgets"]
    placement = Placement(model, raw, groups, sizes=seen["sizes"], budgets=budgets,
                             devices=list(budgets) + ["disk"],
                             no_split=call.get("no_split_module_classes") or ())
    device_map = upstream["OrderedDict"](placement.repair())
    if clean:
        device_map = upstream["clean_device_map"](device_map)
    return device_map


PATCH = Patch(
    id=PATCH_ID,
    title="accelerate infer_auto_device_map keeps declared (regex-expanded) tied groups together, counted once",
    # Measured (selftest tied-llama-budget-sweep, budget-sweep) on accelerate 1.10.1-1.15.0: the tied group is
    # split wherever transformers builds its meta models untied (5.x); the window starts at 1.10.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        Target(
            "accelerate.utils.modeling", "infer_auto_device_map",
            fingerprints=("f6bbd1fa22fcc611",),  # accelerate 1.10.1 - 1.15.0 (unchanged)
            wrapper=_infer_auto_device_map,
            aliases=("accelerate:infer_auto_device_map", "accelerate.utils:infer_auto_device_map",
                     "accelerate.big_modeling:infer_auto_device_map", "peft.peft_model:infer_auto_device_map"),
        ),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/pull/46625",),
        forwarded="no",
        note="Not fixed in accelerate 1.15.0 (latest checked): ties by identity only, IndexError in "
             "get_module_size_with_ties once a tied member is placed before its source.",
    ),
    diagnoses=("tied-split", "no-hf-device-map"),  # metapatch.diagnose findings this fixes
)
