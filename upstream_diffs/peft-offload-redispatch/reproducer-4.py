"""PeftModel.from_pretrained on a base offloaded to cpu/disk, without device_map or max_memory:
load_adapter dispatches the model again with a new "auto" map, which on a CPU-only machine puts
everything in memory (peft releases: model.to() on the meta weights, "Cannot copy out of meta
tensor"), instead of keeping the placement chosen for the base.

Fails with: AssertionError
"""
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
    base = AutoModelForCausalLM.from_pretrained(f"{tmp}/base", device_map=device_map, offload_folder=f"{tmp}/offload")
    try:
        model = PeftModel.from_pretrained(base, f"{tmp}/adapter")
    except NotImplementedError as error:  # "Cannot copy out of meta tensor"
        raise AssertionError(f"load_adapter moved the offloaded weights: {error}") from error
    placement = {key.removeprefix("base_model.model."): device for key, device in model.hf_device_map.items()}
assert placement == device_map, f"the placement chosen for the base is lost: {placement}"
print("ok: the base keeps its placement")
