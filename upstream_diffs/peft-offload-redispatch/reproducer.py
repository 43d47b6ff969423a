"""A LoRA adapter loaded over a base model offloaded to cpu/disk computes the wrong thing, or fails.

`PeftModel.from_pretrained` injects the adapter and then re-dispatches the base: the adapter weights
of offloaded layers are left on meta or moved off their layer's offload hook, the map is re-inferred,
and (depending on the versions) the forward raises a meta-tensor error or returns wrong logits.

Fails with: AssertionError
"""
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
              "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
              "lm_head": "cpu"}
torch.manual_seed(0)
ids = torch.randint(0, 128, (1, 8))
with tempfile.TemporaryDirectory() as tmp:
    LlamaForCausalLM(config).save_pretrained(f"{tmp}/base")
    lora = LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # a non-zero adapter
    get_peft_model(LlamaForCausalLM.from_pretrained(f"{tmp}/base"), lora).save_pretrained(f"{tmp}/adapter")
    with torch.no_grad():
        expected = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(f"{tmp}/base"), f"{tmp}/adapter")(ids).logits
        base = LlamaForCausalLM.from_pretrained(f"{tmp}/base", device_map=device_map, offload_folder=f"{tmp}/offload")
        try:
            logits = PeftModel.from_pretrained(base, f"{tmp}/adapter")(ids).logits
        except (RuntimeError, NotImplementedError, ValueError, KeyError) as error:  # which one: versions
            raise AssertionError(f"the adapter over the offloaded base failed: {type(error).__name__}: {error}") from error
    torch.testing.assert_close(logits, expected)  # wrong logits without the fix
print("ok: the adapter over the offloaded base computes what it does in memory")
