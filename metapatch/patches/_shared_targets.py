"""Fingerprints of the upstream objects that more than one patch wraps, declared once: two records
of one target read the same list, so a release measured for one counts for the other and the two
cannot drift apart (the survey adds a fingerprint here, not in each record).

Each entry: ``(fingerprint, first release, last release)`` of the distribution the target lives in,
oldest first. A record whose range starts later takes the tail with ``since=`` (the first release
it claims), so no record lists code it does not patch.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

Variant = Tuple[str, str, str]  # (fingerprint, first release, last release)

FINGERPRINTS: Dict[str, Tuple[Variant, ...]] = {
    # accelerate-fsdp2-shared-embeddings (>= 1.14), fsdp-rank-placeholders (>= 1.13)
    "accelerate.utils.fsdp_utils:fsdp2_prepare_model": (
        ("1a0bf6a75352e1ea", "1.13.0", "1.13.0"),
        ("13a713c1f6c4e775", "1.14.0", "1.14.0"),
        ("fcc073ba365290bd", "1.15.0", "1.15.0"),
        ("dc5a3b98004b47f4", "1.16.0", "1.16.0"),
    ),
    # accelerate-tie-before-load, empty-init-nonpersistent-buffers
    "accelerate.utils.modeling:load_checkpoint_in_model": (
        ("5b18bd1bf317a2c4", "1.10.0", "1.10.1"),
        ("18e8cb3be7919183", "1.11.0", "1.15.0"),
        ("30a62c8401e20585", "1.16.0", "1.16.0"),
    ),
    # empty-built-nonpersistent-buffers, fsdp-rank-placeholders (transformers)
    "transformers.modeling_utils:PreTrainedModel._move_missing_keys_from_meta_to_device": (
        ("eed015c788f0819c", "5.7.0", "5.15.1"),
        ("c983ef0a97739742", "5.16.0", "5.22.2"),
        ("c92710a756fd8d14", "5.23.0", "5.24.0"),
    ),
    # accelerate-dispatch-skip-keys, accelerate-unindexed-disk-tensors
    "accelerate.big_modeling:dispatch_model": (
        ("398cfc87e4986362", "1.10.0", "1.12.0"),
        ("0eeb48d0a8604931", "1.13.0", "1.14.0"),
        ("81f88a737d7c9ee3", "1.15.0", "1.15.0"),
        ("4b4fdc27416f81b5", "1.16.0", "1.16.0"),
    ),
    # transformers-quantized-disk-weights, transformers-mismatched-disk-weights
    "transformers.core_model_loading:offload_and_maybe_resave_param": (
        ("0571c85df1e591dc", "5.1.0", "5.25.0"),
    ),
    # offloaded-move-guard, offloaded-placeholder-writes (read from each release, 1.10.0 to 1.16.0)
    "accelerate.hooks:AlignDevicesHook.init_hook": (
        ("a48dc7e28ef453c0", "1.10.0", "1.16.0"),
    ),
    # offloaded-outside-reads, tied-device-map-meta-pointer (1.10.x and 1.11+ differ in annotations
    # only: the same call)
    "accelerate.hooks:attach_align_device_hook_on_blocks": (
        ("ba8352e5bc395909", "1.10.0", "1.10.1"),
        ("a26f68e39cdf4503", "1.11.0", "1.15.0"),
    ),
}


def _release(text: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def shared_fingerprints(dotted: str, since: Optional[str] = None) -> Tuple[str, ...]:
    """The fingerprints of ``dotted`` ("module:qualname"), oldest first; with ``since``, only those of
    code still in use at that release or later."""
    variants = FINGERPRINTS[dotted]
    if since is not None:
        variants = tuple(v for v in variants if _release(v[2]) >= _release(since))
    return tuple(v[0] for v in variants)
