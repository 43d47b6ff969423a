"""transformers' infer_auto_device_map splits regex-declared tied groups, or raises IndexError.

DiffusionGemma ties its encoder's whole text stack to its decoder through regex `_tied_weights_keys`
(expanded into `all_tied_weights_keys`); on the meta model that `device_map="auto"` maps they are not
applied yet, and the copies come before their sources: groups land on two devices (their copies stay
on meta), budgets are overrun, and small budgets raise `IndexError` in `get_module_size_with_ties`.

Fails with: AssertionError
"""
import transformers
from accelerate import init_empty_weights

if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):  # transformers < 5.11
    raise SystemExit(print("n/a: this transformers has no DiffusionGemma") or 77)  # 77: not applicable
from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig
from transformers.integrations.accelerate import infer_auto_device_map

text = DiffusionGemmaTextConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, num_global_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_experts=4, top_k_experts=2,
    moe_intermediate_size=16, max_position_embeddings=64)
vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4)
config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=4)
with init_empty_weights():
    model = transformers.DiffusionGemmaForBlockDiffusion(config)
tied = model.all_tied_weights_keys  # copy -> source
sizes = {n: t.numel() * t.element_size() for n, t in model.named_parameters(remove_duplicate=False) if n not in tied}
total = sum(sizes.values())

for fraction in (1.0, 0.6, 0.3, 0.1, 0.02):
    budgets = {"cpu": int(total * fraction)}
    try:
        device_map = infer_auto_device_map(model, max_memory=dict(budgets), no_split_module_classes=model._no_split_modules)
    except IndexError as error:
        raise AssertionError(f"budgets {budgets}: IndexError: {error}") from error

    def device_of(name):
        return device_map[max((k for k in device_map if k in ("", name) or name.startswith(k + ".")), key=len)]

    split = [(copy, source) for copy, source in tied.items() if device_of(copy) != device_of(source)]
    assert not split, f"budgets {budgets}: {len(split)} tied copies not with their source, e.g. {split[0]}"
    used = sum(size for name, size in sizes.items() if device_of(name) == "cpu")
    assert used <= budgets["cpu"], f"budgets {budgets}: {used} bytes on cpu"
print("ok: every tied group on one device, every budget kept")
