"""merge_and_unload on a model that accelerate dispatched from a checkpoint with disk offload
(load_checkpoint_and_dispatch writes the disk weights as .dat files): onload_layer looks up a
"safetensors_file" that their offload index does not have.

Fails with: KeyError
"""
import tempfile

import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
              "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
              "lm_head": "cpu"}
with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(f"{tmp}/base")
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    model = load_checkpoint_and_dispatch(model, f"{tmp}/base", device_map=device_map, offload_folder=f"{tmp}/off")
    model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"]))
    merged = model.merge_and_unload()  # KeyError: 'safetensors_file'
    with torch.no_grad():
        merged(torch.arange(8).view(1, 8))
print("ok: merged")
