"""DiffusionGemma's decoder reads ``embed_tokens.weight`` directly, outside the embedding's own forward
(the self-conditioning soft embeddings). With the embedding offloaded (disk, or cpu offload on a GPU
machine) accelerate has put that weight back on meta by then, so denoising steps after the first
compute on a meta weight and ``generate()`` fails ("probability tensor contains either inf, nan ...").
Seen with accelerate 1.13 (transformers 5.11) once the tied-device-map patches let such a model
dispatch at all. The fix keeps the embedding's offloaded weight materialised for the duration of the
decoder's forward and offloads it again afterwards (metapatch._offload.offloaded_weights, shared with
gemma4-offloaded-embeddings).
"""

from __future__ import annotations

from .._offload.offloaded_weights import call_with_materialised
from .._framework.records import Patch, Target, Upstream

PATCH_ID = "diffusion-gemma-offloaded-embeddings"


PATCH = Patch(
    id=PATCH_ID,
    title="DiffusionGemma generate() with an offloaded embedding: the decoder's direct embed_tokens.weight read sees the real weight",
    # Measured (selftest generate-offloaded-embedding): fails on 5.12.1 (first on the disk-index bug), 5.13.1,
    # 5.15.1, 5.17.0, 5.19.0, 5.21.1, 5.23.0 (NaN probabilities / wrong tied tensor). On 5.24.0 the scenario
    # passes unpatched, yet the direct embed_tokens.weight read is still there (the upstream diff applies):
    # the range stays open. DiffusionGemma arrived in 5.11.
    affects={"transformers": ">=5.11.0"},
    targets=(
        Target(
            "transformers.models.diffusion_gemma.modeling_diffusion_gemma", "DiffusionGemmaDecoderModel.forward",
            fingerprints=(
                "7437510428ee6ce6",  # 5.11.0
                "8d97bb39d2c3a286",  # 5.12.0 - 5.12.1
                "1a3d716650a3f25a",  # 5.13.0 - 5.14.1
                "879b305c661deb72",  # 5.15.0 - 5.22.2
                "a07cd94adcafac70",  # 5.23.0
                "5ddcfa43de72bb1d",  # 5.24.0 (renames only)
            ),
            wrapper=call_with_materialised("embed_tokens"),  # the decoder reads embed_tokens.weight directly
        ),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/pull/46625",),
        forwarded="no",
        note="The decoder should embed soft tokens through embed_tokens' forward (or force_accelerate_hooks); "
             "see the upstream diff. On 5.24.0 the shipped scenario no longer reproduces it although the "
             "decoder still reads the weight directly (not explained yet).",
    ),
)
