"""accelerate-root-disk-map: a device map that puts the whole model on disk (``{"": "disk"}``, what
``infer_auto_device_map`` returns when no execution device has room for anything) dispatches: the whole
state dict is offloaded and every module loads its weights from disk in its forward. Upstream
``dispatch_model`` (1.15.0) fails with ``FileNotFoundError: .../index.json``; releases up to 1.14 refused
the map with a clear ``ValueError`` (use ``disk_offload``), a check 1.15.0 removed.

``dispatch_model`` offloads the weights of the map's disk entries with ``extract_submodules_state_dict``,
which keeps the keys equal to an entry or under ``entry + "."``. For the root entry ``""`` that is no key
at all (no state-dict key starts with "."), so nothing is written, no ``index.json`` either, and the
weights loader then cannot open the folder. The root names every key: that is what this patch returns.
Any other entry calls upstream untouched.
"""

from __future__ import annotations

from typing import Any

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream

PATCH_ID = "accelerate-root-disk-map"


def _extract(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    names = bound.arguments.get("submodule_names")
    if names is None or "" not in list(names):
        return wrapped(*args, **kwargs)
    return dict(bound.arguments["state_dict"])  # the root module holds every tensor of the state dict


PATCH = Patch(
    id=PATCH_ID,
    title='a device map with the whole model on disk ({"": "disk"}, as infer_auto_device_map returns it when '
          'nothing fits) dispatches instead of failing on a missing index.json',
    # extract_submodules_state_dict drops the root name "" in every release (the bug the diff fixes). Through
    # dispatch_model it shows on 1.15.0, which dropped the earlier check; accelerate <= 1.14 refuses the map
    # first with a clear ValueError ("offload the whole model to the disk. Please use the `disk_offload`
    # function instead"), so the scenario is n/a there (measured: 1.13.0, 1.14.0 ValueError; 1.15.0
    # FileNotFoundError). Patched everywhere the function has the bug.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        Target("accelerate.utils.offload", "extract_submodules_state_dict",
               fingerprints=("183a14add7f37f99",),  # accelerate 1.10.0 - 1.15.0
               wrapper=_extract,
               aliases=("accelerate.utils:extract_submodules_state_dict",
                        "accelerate.big_modeling:extract_submodules_state_dict")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues?q=dispatch_model+disk+index.json",),
        forwarded="no",
        note="accelerate: extract_submodules_state_dict treats the root name \"\" as every key",
    ),
)
