"""load_checkpoint_and_dispatch of a tied model built under init_empty_weights (accelerate#1289).

The documented big-model recipe, without the extra `model.tie_weights()` call: the empty model is not
tied, the checkpoint stores the tied embedding once (no lm_head.weight), so lm_head.weight gets no
value and stays on the meta device.

Fails with: ValueError
"""
import os
import tempfile

import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from transformers import AutoModelForCausalLM, LlamaConfig

config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).eval()
ids = torch.randint(0, 128, (1, 6))
with torch.no_grad():
    expected = model(ids).logits
device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "disk",
              "model.norm": "cpu", "lm_head": "cpu"}
with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)  # stores model.embed_tokens.weight once, no lm_head.weight
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config)
    # without the fix: ValueError: weight is on the meta device, we need a `value` to put in on cpu.
    loaded = load_checkpoint_and_dispatch(empty, tmp, device_map=device_map,
                                          offload_folder=os.path.join(tmp, "offload"))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected), "logits differ from the in-memory model"
print("ok: the empty model was tied and loads exactly")
