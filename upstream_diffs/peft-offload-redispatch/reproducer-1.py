"""get_peft_model on a model that accelerate offloads to cpu/disk: the LoRA weights of the offloaded
layers are moved onto the meta device with their base layer's weights, and the outputs are silently
wrong (NaN here; DoRA fails with "Cannot copy out of meta tensor", IA3 with a meta tensor).

Fails with: AssertionError
"""
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
              "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
              "lm_head": "cpu"}
lora = LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # a non-zero adapter
ids = torch.arange(8).view(1, 8)
with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(f"{tmp}/base")
    torch.manual_seed(1)
    expected = get_peft_model(AutoModelForCausalLM.from_pretrained(f"{tmp}/base"), lora)
    base = AutoModelForCausalLM.from_pretrained(f"{tmp}/base", device_map=device_map, offload_folder=f"{tmp}/offload")
    torch.manual_seed(1)
    model = get_peft_model(base, lora)  # the same adapter, over the offloaded base
    with torch.no_grad():
        want, got = expected(ids).logits, model(ids).logits
devices = sorted({p.device.type for name, p in model.named_parameters() if "lora_" in name})
assert torch.allclose(got, want), f"the outputs differ from the in-memory model's (LoRA weights on {devices})"
print("ok: the adapter over the offloaded base computes what it does in memory")
