"""diffusion-gemma-offloaded-embeddings: three-way proof on its scenarios (subprocesses; DiffusionGemma's generate reads its offloaded embedding). What the tied-map family's files share, and
the releases measured, is in _tied_three_way.py."""

from __future__ import annotations

from metapatch.patches.diffusion_gemma_offloaded_embeddings import PATCH

from _tied_three_way import TiedThreeWay  # tests/patches/_tied_three_way.py


class TestThreeWay(TiedThreeWay):
    patch_ids = (PATCH.id,)
