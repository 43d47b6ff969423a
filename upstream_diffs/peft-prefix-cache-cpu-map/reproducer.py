"""Prefix tuning fails at the first forward when the base's device map names no accelerator.

A tiny Llama with its odd layers and lm_head offloaded to disk and the rest on "cpu" (a machine without a
GPU), a prefix-tuning adapter: get_layer_device_map looks for the map's accelerator and finds none.

Fails with: StopIteration|IndexError
"""
import sys
import tempfile

import torch
from peft import PrefixTuningConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
prefix = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
ids = torch.arange(1, 9)[None]
with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(f"{folder}/base")
    torch.manual_seed(1)
    reference = get_peft_model(LlamaForCausalLM.from_pretrained(f"{folder}/base"), prefix).eval()
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk"}
    device_map.update({f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(4)})
    base = LlamaForCausalLM.from_pretrained(f"{folder}/base", device_map=device_map, offload_folder=f"{folder}/off")
    model = get_peft_model(base, prefix).eval()
    set_peft_model_state_dict(model, get_peft_model_state_dict(reference))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        try:
            got = model(input_ids=ids).logits
        except StopIteration:  # peft >= 0.20 raises it bare; name it on the last line like any other error
            sys.exit("StopIteration: get_layer_device_map found no device other than cpu/disk in the map")
        assert torch.equal(got, expected), (got - expected).abs().max()
        tokens = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, reference.generate(input_ids=ids, max_new_tokens=4, do_sample=False))
print("ok")
