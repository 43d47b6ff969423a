"""gemma4-offloaded-embeddings: Gemma 4 with per-layer inputs reads ``embed_tokens.weight`` directly, outside
the embedding's own forward, so with the embedding offloaded (disk, or cpu offload on a GPU machine) it
meets accelerate's meta placeholder: ``RuntimeError: Tensor on device meta is not on the expected device
cpu!`` (on a GPU machine: ``... expected device cuda:0``).

Two reads, both only in models with per-layer inputs (``hidden_size_per_layer_input``, the E2B/E4B sizes):

* ``Gemma4Model.forward`` (``Gemma4ForConditionalGeneration``, every text or multimodal call) takes
  ``language_model.embed_tokens.weight[pad_token_id]`` to blank multimodal positions before the
  per-layer lookup;
* ``Gemma4TextModel.get_per_layer_inputs`` (``Gemma4ForCausalLM`` and the above, called with
  ``inputs_embeds`` and no ``input_ids``, e.g. ``generate(inputs_embeds=...)``) compares the inputs with
  ``embed_tokens.weight`` to recover the token ids.

The fix is the one diffusion-gemma-offloaded-embeddings makes for DiffusionGemma (the shared
metapatch._offload.offloaded_weights): the embedding's offloaded weight stays materialised for the duration of
the call and is offloaded again afterwards. Nothing changes where the embedding is not offloaded.
"""

from __future__ import annotations

from .._offload.offloaded_weights import call_with_materialised
from .._framework.records import Patch, Target, Upstream

PATCH_ID = "gemma4-offloaded-embeddings"
_MODULE = "transformers.models.gemma4.modeling_gemma4"

PATCH = Patch(
    id=PATCH_ID,
    title="Gemma 4 with per-layer inputs and an offloaded embedding: the direct embed_tokens.weight reads see the real weight",
    # Measured (selftest conditional-generation-embedding-on-disk, causal-lm-inputs-embeds-embedding-on-disk,
    # unpatched: RuntimeError "Tensor on device meta is not on the expected device cpu!"): transformers
    # 5.11.0, 5.17.0, 5.24.0. Gemma 4 arrived in 5.5.0; every release since has both direct reads (checked
    # in the source of each code variant below), so the range starts there and stays open.
    affects={"transformers": ">=5.5.0"},
    targets=(
        Target(_MODULE, "Gemma4Model.forward",
               fingerprints=(
                   "7571636aa0998303",  # 5.5.0 - 5.5.4
                   "68f63a4f65a36f1e",  # 5.6.0 - 5.7.0
                   "89cedb9a6f862d48",  # 5.8.0 - 5.8.1
                   "227c14059b7d445c",  # 5.9.0
                   "b71481090b6c6af3",  # 5.10.1 - 5.12.1
                   "f44a55f94c692d55",  # 5.13.0 - 5.14.1
                   "c57ccf142c8f1378",  # 5.15.0
                   "cf7949da4eac8f57",  # 5.15.1 - 5.17.0
                   "e9ee4c7790d0a58e",  # 5.18.0
                   "6adf846d9a7f6761",  # 5.19.0 - 5.22.2
                   "e16e5ee8eb381fb4",  # 5.23.0
                   "c95ea546300d87e1",  # 5.24.0
                   "1ab08a7a16121152",  # 5.25.0 (an audio variable renamed: the same reads)
               ),
               wrapper=call_with_materialised("language_model.embed_tokens")),
        Target(_MODULE, "Gemma4TextModel.get_per_layer_inputs",
               fingerprints=(
                   "01ec4fed3388ad25",  # 5.5.0 - 5.20.2
                   "4a2c76fa9259b83d",  # 5.21.0 - 5.24.0
               ),
               wrapper=call_with_materialised("embed_tokens")),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/pull/48409",),
        forwarded="no",
        note="upstream fix: take the pad embedding through language_model.embed_tokens' forward, and recover "
             "input_ids inside a call that loads the offloaded weight; see the upstream diff",
    ),
)
