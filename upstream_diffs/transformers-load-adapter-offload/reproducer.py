"""`model.load_adapter(path)` on a model with layers offloaded to disk never loads those layers' adapter weights.

`load_adapter` passes the base's `hf_device_map` on: the LoRA weights of layers mapped to "disk" go to an
offload index that is then dropped, so they keep their meta placeholders or random initialisation and the
logits are wrong (NaN or silently different), huggingface/transformers#33744. transformers 4.57 instead
re-dispatches the model and stops with "You can't move a model that has some modules offloaded".

Fails with: AssertionError
"""
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))


def logits_and_tokens(model):
    with torch.no_grad():
        return model(input_ids=ids).logits, model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)


# Layers 2 and 3 (which the adapter targets, as it targets every layer) on disk, the rest in memory
device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu",
              "lm_head": "cpu"}
with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(f"{tmp}/base")
    torch.manual_seed(3)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                      init_lora_weights=False)  # non-zero adapter weights
    get_peft_model(AutoModelForCausalLM.from_pretrained(f"{tmp}/base"), lora).save_pretrained(f"{tmp}/adapter")

    reference = AutoModelForCausalLM.from_pretrained(f"{tmp}/base").eval()
    reference.load_adapter(f"{tmp}/adapter")
    expected_logits, expected_tokens = logits_and_tokens(reference)

    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/base", device_map=device_map,
                                                 offload_folder=f"{tmp}/offload").eval()
    assert model.model.layers[3].self_attn.q_proj.weight.is_meta, "layer 3 was meant to be offloaded"
    try:
        model.load_adapter(f"{tmp}/adapter")
    except RuntimeError as error:  # transformers 4.57: the re-dispatch after loading refuses
        raise AssertionError(f"load_adapter failed: {error}") from error
    logits, tokens = logits_and_tokens(model)
diff = (logits - expected_logits).abs().max().item()
assert torch.equal(logits, expected_logits), f"logits differ from the in-memory model (max abs diff {diff})"
assert torch.equal(tokens, expected_tokens), f"{tokens.tolist()} != in-memory {expected_tokens.tolist()}"
print("ok: the adapter on the offloaded model gives the in-memory model's logits and tokens")
