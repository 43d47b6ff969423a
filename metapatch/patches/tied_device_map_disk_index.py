"""Disk-offloaded tied copies get an offload-index entry (transformers 5.0-5.12).

When a tied group is offloaded to disk, only its source is in the checkpoint, so
``accelerate_disk_offload`` indexes only the source's name; the offload hook of the tied copy (e.g.
DiffusionGemma's ``model.encoder.language_model.embed_tokens``) then looks its own name up and fails
with ``KeyError`` at the first forward (a tied Llama with ``embed_tokens`` and ``lm_head`` both on
disk: ``KeyError: 'lm_head.weight'``). transformers 5.13 adds the declared tied names to the index;
this backports that, for declared and identity ties alike. (4.57 builds its index elsewhere:
tied-device-map-transformers-v4.)
"""

from __future__ import annotations

from .._framework.records import Patch, Target, Upstream

PATCH_ID = "tied-device-map-disk-index"


def _accelerate_disk_offload(wrapped, instance, args, kwargs):
    from .._offload.tied_members import index_tied_members

    index = wrapped(*args, **kwargs)
    model = kwargs.get("model", args[0] if args else None)
    if not index or model is None:
        return index
    return index_tied_members(index, model)


PATCH = Patch(
    id=PATCH_ID,
    title="disk-offloaded tied weights (DiffusionGemma's encoder stack) get offload-index entries: no KeyError at forward",
    # Measured (selftest tied-llama-both-on-disk): KeyError on 5.0.0, 5.3.0, 5.9.0, 5.11.0, 5.12.1; passes
    # unpatched on 5.13.1 and later (5.13 indexes declared tied weights that are both on disk).
    affects={"transformers": ">=5.0.0.dev0,<5.13.0"},
    targets=(
        Target(
            "transformers.integrations.accelerate", "accelerate_disk_offload",
            fingerprints=(
                "c2a3fd987850bdc8",  # 5.0.0 - 5.8.1
                "3b93ed9920030b70",  # 5.9.0
                "c8c934bc2efad96b",  # 5.10.1 - 5.12.1
            ),
            wrapper=_accelerate_disk_offload,
            aliases=("transformers.modeling_utils:accelerate_disk_offload",),
        ),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/pull/46625",),
        forwarded="not-needed",
        fixed_in={"transformers": "5.13.0"},
        note="transformers 5.13.0 indexes disk-offloaded declared tied weights (measured: 5.12.1 affected, "
             "5.13.1 fixed).",
    ),
    diagnoses=("tied-split", "no-hf-device-map"),  # metapatch.diagnose findings this fixes
)
