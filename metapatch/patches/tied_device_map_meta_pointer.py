"""Offloaded tied weights no longer share one cache slot (accelerate before 1.15).

``dispatch_model`` keys its cache of materialised tied parameters by ``data_ptr()``. Every meta
tensor reports pointer 0, so when several tied groups are offloaded together (DiffusionGemma's
encoder/decoder stack on disk) they all share the slot ``0``: the first weight materialised (the
embedding) is handed to every other tied module, and the first forward fails with a shape error or,
worse, computes with the wrong weight. accelerate 1.15 skips meta tensors when building the cache;
this drops the shared ``0`` slot before the hooks are attached, which is the same thing.
"""

from __future__ import annotations

from .._framework.records import Patch, Target, Upstream
from ._shared_targets import shared_fingerprints

PATCH_ID = "tied-device-map-meta-pointer"


def _attach_align_device_hook_on_blocks(wrapped, instance, args, kwargs):
    tied_params_map = kwargs.get("tied_params_map")
    if isinstance(tied_params_map, dict):
        tied_params_map.pop(0, None)  # the pointer of every meta tensor, never a real allocation
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id=PATCH_ID,
    title="offloaded tied weights get their own values, not the first tied weight loaded (meta pointer 0)",
    # Measured (selftest two-tied-groups-on-disk): reproduces on 1.10.1, 1.11.0, 1.12.0, 1.13.0, 1.14.0;
    # absent on 1.15.0. The window starts at 1.10.
    affects={"accelerate": ">=1.10.0,<1.15.0"},
    targets=(
        Target(
            "accelerate.hooks", "attach_align_device_hook_on_blocks",
            # 1.15 fixed the caller (dispatch_model), not this function: the 1.15.0 code is listed too.
            fingerprints=shared_fingerprints("accelerate.hooks:attach_align_device_hook_on_blocks"),
            wrapper=_attach_align_device_hook_on_blocks,
            aliases=("accelerate.big_modeling:attach_align_device_hook_on_blocks",),
        ),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/pull/4083",),
        forwarded="not-needed",
        fixed_in={"accelerate": "1.15.0"},
        note="accelerate 1.15.0 skips meta tensors when building tied_params_map in dispatch_model; measured "
             "affected on 1.10.1-1.14.0, fixed on 1.15.0.",
    ),
    diagnoses=("tied-split", "no-hf-device-map"),  # metapatch.diagnose findings this fixes
    # Both replace attach_align_device_hook_on_blocks on accelerate < 1.15; the order does not change
    # either result (this one only edits the arguments), it is declared so that it never changes by accident.
    wraps_over=("offloaded-outside-reads",),
)
