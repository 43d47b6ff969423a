"""`model.device` says `meta` when the model's first parameter is offloaded, so `generate()` fails.

`ModuleUtilsMixin.device` is the device of the model's first parameter. accelerate keeps an offloaded
parameter (here `model.embed_tokens` on disk; cpu offload on a GPU machine does the same) on meta between
forward passes, so the usual `inputs = tokenizer(...).to(model.device)` sends the prompt to meta and
`generate()` fails with "Tensor.item() cannot be called on meta tensors". (transformers 4.57 has the same bug in
`get_parameter_device`, patched there as offloaded-model-device-v4.)

Fails with: RuntimeError
Affected: offloaded-model-device, offloaded-model-device-v4
"""
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}  # what a tokenizer returns
greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
expected = model.generate(**prompt, **greedy)

# The embedding (the first parameter) on disk, everything else in memory
device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
              "lm_head": "cpu"}
with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    offloaded = LlamaForCausalLM.from_pretrained(tmp, device_map=device_map, offload_folder=f"{tmp}/offload").eval()
    assert offloaded.model.embed_tokens.weight.is_meta, "the embedding was meant to be offloaded"
    print("model.device:", offloaded.device)  # without the fix: meta
    inputs = {name: tensor.to(offloaded.device) for name, tensor in prompt.items()}
    generated = offloaded.generate(**inputs, **greedy)
assert torch.equal(generated, expected), f"{generated.tolist()} != in-memory {expected.tolist()}"
print("ok: model.device is", offloaded.device, "and generate() equals the in-memory model")
