"""cpu_offload / disk_offload / dispatch_model over a model whose weights accelerate already offloads.

A tiny Llama loaded with two decoder layers on disk keeps those weights as meta placeholders behind offload
hooks; accelerate's placement functions read model.state_dict() and copy out of meta.

Fails with: NotImplementedError
"""
import tempfile

import torch
from accelerate import disk_offload
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
ids = torch.arange(1, 9)[None]
with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(f"{folder}/base")
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(f"{folder}/base")(ids).logits
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i >= 2 else "cpu" for i in range(4)})
    model = LlamaForCausalLM.from_pretrained(f"{folder}/base", device_map=device_map, offload_folder=f"{folder}/off")
    try:
        disk_offload(model, f"{folder}/new", execution_device="cpu")
    except ValueError as exc:  # the fix: a clear refusal that names the offloading, before anything is written
        assert "already offloaded" in str(exc) and "device_map" in str(exc), exc
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
print("ok")
