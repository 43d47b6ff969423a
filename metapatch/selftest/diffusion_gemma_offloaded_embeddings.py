"""Reproducer for diffusion-gemma-offloaded-embeddings: DiffusionGemma generate() with its tied
embeddings offloaded to disk (n/a before transformers 5.11, which has no DiffusionGemma)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Expect, Scenario
from ._tied import LOGITS_TOLERANCE, check_dispatched, compare, diffusion_gemma_class, on_main, save_tiny

PATCH_ID = "diffusion-gemma-offloaded-embeddings"

EMBEDDING_OFFLOAD_MAP = {"model.encoder.language_model": "disk", "model.encoder.vision_tower": "cpu",
                         "model.encoder.embed_vision": "cpu", "model.decoder": "disk", "lm_head": "disk"}


def generate_with_offloaded_embedding(workdir: Path) -> Dict[str, Any]:
    """DiffusionGemma generate() with the (tied) embeddings offloaded to disk: the decoder reads
    embed_tokens.weight outside the embedding's hook, on meta (NaN probabilities)."""
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()
    path, reference = save_tiny(workdir / "ckpt")
    loaded = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, device_map=on_main(EMBEDDING_OFFLOAD_MAP), offload_folder=str(workdir / "offload")).eval()
    diff = compare(loaded, reference)
    check_dispatched(loaded)
    return {"max_abs_diff": diff}



SCENARIOS = [
    Scenario(PATCH_ID, "generate-offloaded-embedding", f"{__name__}:generate_with_offloaded_embedding",
             "DiffusionGemma generate() with the tied embeddings on disk: the decoder's direct "
             "embed_tokens.weight read sees meta (NaN probabilities)", expected_error="RuntimeError",
             tolerance=LOGITS_TOLERANCE, unpatched=(
                 # 5.11-5.12 fail first on the missing offload-index entry of the tied embedding (disk-index bug)
                 Expect("KeyError", when={"transformers": "<5.13.0.dev0"}),
                 # From 5.13 the direct read gets memory the meta placeholder never initialised (torch's cpu @
                 # meta matmul does not raise): NaN probabilities in generate() (RuntimeError), or, when
                 # generate()'s few greedy tokens come out right by chance (seen on 5.23.0 and 5.24.0),
                 # self-conditioned logits that differ from the in-memory model's (AssertionError).
                 Expect("RuntimeError|AssertionError"))),
]
