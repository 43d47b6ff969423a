"""DiffusionGemma's decoder reads `embed_tokens.weight` outside the embedding's forward: offloaded, it is meta.

The decoder embeds self-conditioning soft tokens with `torch.matmul(probs, self.embed_tokens.weight)`. With the
embedding offloaded by accelerate (disk here, or cpu offload on a GPU) that weight is a meta placeholder there: the
logits are garbage (cpu @ meta gives uninitialised memory); generate(): "probability tensor contains ... `nan`".

Fails with: AssertionError
"""
import copy
import tempfile

import torch
import transformers
from accelerate import dispatch_model

if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):  # transformers < 5.11
    raise SystemExit(print("n/a: this transformers has no DiffusionGemma") or 77)  # 77: not applicable
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
from transformers import Gemma4VisionConfig

text = DiffusionGemmaTextConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, num_global_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_experts=4, top_k_experts=2,
    moe_intermediate_size=16, max_position_embeddings=64, eos_token_id=1, pad_token_id=0, bos_token_id=2)
vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4)
config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=4, boi_token_id=120,
                              eoi_token_id=121, image_token_id=122)
torch.manual_seed(0)
model = DiffusionGemmaForBlockDiffusion(config).eval()
prompt, canvas = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[11, 12, 13, 14]])
soft = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(1))  # a previous denoising step's logits


def logits_of(m):  # one self-conditioned decoder pass, as generate()'s later denoising steps do
    with torch.no_grad():
        return m(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=soft).logits


def tokens_of(m):
    torch.manual_seed(0)  # the denoiser samples (torch.multinomial) even when greedy
    generated = m.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, max_denoising_steps=3)
    return getattr(generated, "sequences", generated)


# The text stack (whose embedding the decoder shares) and the decoder on disk. dispatch_model, as from_pretrained
# ends with: from_pretrained(device_map=...) meets other tied-weight offload bugs of this model before 5.24.
device_map = {"model.encoder.language_model": "disk", "model.encoder.vision_tower": "cpu",
              "model.encoder.embed_vision": "cpu", "model.decoder": "disk", "lm_head": "disk"}
expected_logits, expected_tokens = logits_of(model), tokens_of(model)
with tempfile.TemporaryDirectory() as tmp:
    offloaded = dispatch_model(copy.deepcopy(model), device_map, offload_dir=tmp)
    assert offloaded.model.decoder.embed_tokens.weight.is_meta, "the embedding was meant to be offloaded"
    diff = (logits_of(offloaded) - expected_logits).abs().max().item()  # without the fix: NaN, or garbage
    assert diff <= 1e-5, f"self-conditioned logits differ from the in-memory model's (max abs diff {diff})"
    tokens = tokens_of(offloaded)
assert torch.equal(tokens, expected_tokens), f"{tokens.tolist()} != in-memory {expected_tokens.tolist()}"
print("ok: the self-conditioned logits and generate() equal the in-memory model's")
