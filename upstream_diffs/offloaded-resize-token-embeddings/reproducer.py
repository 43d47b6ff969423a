"""`resize_token_embeddings` of a model whose embedding and head are offloaded builds the new ones on meta.

accelerate keeps offloaded weights (here `model.embed_tokens` and `lm_head` on disk) on meta between forward
passes. The resize reads those placeholders: mean resizing (the default) fails with "Tensor.item() cannot be
called on meta tensors"; with `mean_resizing=False` it returns, and the first forward fails because the
offload hook still serves the old [128, 64] weight (huggingface/transformers#25554).

Fails with: RuntimeError
"""
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
ids = torch.cat([torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1)),
                 torch.arange(128, 132)[None]], dim=1)  # new token ids too


def resized(m):
    torch.manual_seed(100)  # mean resizing samples the new rows
    m.resize_token_embeddings(140)
    with torch.no_grad():
        return m(input_ids=ids).logits, m.generate(input_ids=ids, max_new_tokens=4, do_sample=False)


device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu",
              "lm_head": "disk"}
with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    expected_logits, expected_tokens = resized(model)
    offloaded = LlamaForCausalLM.from_pretrained(tmp, device_map=device_map, offload_folder=f"{tmp}/offload").eval()
    assert offloaded.model.embed_tokens.weight.is_meta, "the embedding was meant to be offloaded"
    logits, tokens = resized(offloaded)  # without the fix: Tensor.item() cannot be called on meta tensors
assert torch.equal(logits, expected_logits), f"logits differ: {(logits - expected_logits).abs().max().item()}"
assert torch.equal(tokens, expected_tokens), f"{tokens.tolist()} != in-memory {expected_tokens.tolist()}"
print("ok: the offloaded model resizes as the in-memory model does")
