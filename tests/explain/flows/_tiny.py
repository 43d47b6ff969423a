"""A tiny random Llama checkpoint in the working directory, as a user's own test script would make one."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def checkpoint(tie=False, path="tiny-llama"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


REST_ON_CPU = {"model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu"}
