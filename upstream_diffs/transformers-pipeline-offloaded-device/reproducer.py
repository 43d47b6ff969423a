"""A pipeline cannot be built over a model whose device map starts with "disk".

`Pipeline.__init__` takes its device from the first entry of the model's `hf_device_map`: `torch.device("disk")`
raises. `device_map="auto"` gives such a map whenever the first module does not fit in `max_memory` (here
nothing does: `{"": "disk"}`). accelerate computes the offloaded modules on the CPU here (no accelerator in the
map), which is where the pipeline should send its inputs.

Fails with: RuntimeError
Affected: transformers-pipeline-offloaded-device
"""
import tempfile

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, pipeline

vocab = {f"w{i}": i for i in range(125)}
vocab.update({"[UNK]": 125, "<s>": 126, "</s>": 127})
backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                    pad_token="</s>")
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=127)
torch.manual_seed(0)
greedy = dict(max_new_tokens=6, do_sample=False, return_tensors=True)
with tempfile.TemporaryDirectory() as tmp:
    LlamaForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    expected = pipeline("text-generation", model=tmp, device="cpu")("w3 w17 w5 w99", **greedy)
    pipe = pipeline("text-generation", model=tmp, device_map="auto",
                    model_kwargs={"max_memory": {"cpu": 1000}, "offload_folder": f"{tmp}/offload"})  # without the fix: RuntimeError
    print("device map:", pipe.model.hf_device_map, "pipeline device:", pipe.device)
    generated = pipe("w3 w17 w5 w99", **greedy)
assert pipe.device == torch.device("cpu"), pipe.device
assert generated == expected, f"{generated} != in-memory {expected}"
print("ok: the pipeline runs on the CPU and generates the in-memory pipeline's tokens")
