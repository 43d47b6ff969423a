"""Gemma 4 with per-layer inputs reads `embed_tokens.weight` outside the embedding's forward: offloaded, it is meta.

Gemma 4 models with `hidden_size_per_layer_input` (E2B/E4B) read the weight directly: `Gemma4Model.forward`
takes the pad token's row on every call, and `get_per_layer_inputs` compares `inputs_embeds` with the whole
weight. With `embed_tokens` offloaded by accelerate (disk here; cpu offload on a GPU machine too) that weight
is a meta placeholder there: "Tensor on device meta is not on the expected device cpu!".

Fails with: RuntimeError
"""
import tempfile

import torch
import transformers

if not hasattr(transformers, "Gemma4ForConditionalGeneration"):  # transformers < 5.5
    raise SystemExit(print("n/a: this transformers has no Gemma 4") or 77)  # 77: not applicable
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig
from transformers import Gemma4VisionConfig

text = Gemma4TextConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=16, num_kv_shared_layers=0, sliding_window=16,
    max_position_embeddings=64, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
    bos_token_id=2, tie_word_embeddings=False)
vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4)
multimodal = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=120,
                          eoi_token_id=121, image_token_id=122, video_token_id=123, boa_token_id=124,
                          eoa_token_index=125, audio_token_id=126, tie_word_embeddings=False)
ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(1))  # below the special tokens


def outputs(model, use_embeds):
    with torch.no_grad():  # inputs_embeds through the embedding's own forward (its hook loads the weight)
        inputs = {"inputs_embeds": model.get_input_embeddings()(ids)} if use_embeds else {"input_ids": ids}
        return model(**inputs).logits, model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)


for cls, config, text_model, use_embeds in [(Gemma4ForConditionalGeneration, multimodal, "model.language_model", 0),
                                            (Gemma4ForCausalLM, text, "model", 1)]:
    torch.manual_seed(0)
    model = cls(config).eval()
    # embed_tokens on disk, every other module in memory
    device_map = {f"{text_model}.{name}": "disk" if name == "embed_tokens" else "cpu"
                  for name, _ in model.get_submodule(text_model).named_children()}
    for path in [f"model.{name}" for name, _ in model.model.named_children()] + ["lm_head"]:
        if not any(key == path or key.startswith(path + ".") for key in device_map):
            device_map[path] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        offloaded = cls.from_pretrained(tmp, device_map=device_map, offload_folder=f"{tmp}/offload").eval()
        assert offloaded.get_input_embeddings().weight.is_meta, "the embedding was meant to be offloaded"
        logits, tokens = outputs(offloaded, use_embeds)  # without the fix: RuntimeError (meta weight)
    expected_logits, expected_tokens = outputs(model, use_embeds)
    assert torch.equal(logits, expected_logits), f"logits differ: {(logits - expected_logits).abs().max().item()}"
    assert torch.equal(tokens, expected_tokens), f"{tokens.tolist()} != in-memory {expected_tokens.tolist()}"
    print(f"ok: {cls.__name__} with embed_tokens on disk computes what the in-memory model computes")
