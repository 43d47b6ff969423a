"""PeftModel.from_pretrained on a base offloaded to disk: _update_offload writes a copy of the base
checkpoint with the adapter's keys to a path made relative to the working directory (run from "/",
it overwrites the checkpoint itself). Here, from a fresh working directory, it leaves a copy there.

Fails with: AssertionError
"""
import os
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
              "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
              "lm_head": "cpu"}
with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(f"{tmp}/base")
    lora = LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(f"{tmp}/base"), lora).save_pretrained(f"{tmp}/adapter")
    os.mkdir(f"{tmp}/cwd")
    os.chdir(f"{tmp}/cwd")
    base = AutoModelForCausalLM.from_pretrained(f"{tmp}/base", device_map=device_map, offload_folder=f"{tmp}/offload")
    # a budget that keeps half of the model on the disk, with a folder for what is newly offloaded
    PeftModel.from_pretrained(base, f"{tmp}/adapter", max_memory={"cpu": 400_000}, offload_dir=f"{tmp}/peft_offload")
    written = [os.path.join(root, name) for root, _, names in os.walk(".") for name in names]
    os.chdir("/")
assert not written, f"loading the adapter wrote into the working directory: {written}"
print("ok: nothing written outside the offload folders")
