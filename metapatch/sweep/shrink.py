"""Make any architecture's default config tiny, by attribute name only (no per-model table).

The default config of the class (``ConfigClass()``) is turned into a dict, every key whose name
says what it sizes is shrunk (rules below, first match wins), and the class is built again from
that dict, so ``__init__`` re-derives what depends on the sizes (``layer_types``, head dims,
rope parameters). Nested sub-configs (``text_config``, ``vision_config``, ``encoder``...) are
shrunk the same way. Derived lists whose length follows the layer count are dropped so that
``__init__`` recomputes them (so are lists and dicts whose key names a layer), except a ``layer_types``
of several kinds, which keeps one layer of each; token ids above the shrunk vocabulary are moved inside it. A config
this cannot shrink consistently fails to build or run in memory, and the sweep lists it with
the error (docs/sweep.md, "cannot build").
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Callable, Dict, List, Tuple

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
VOCAB = 256

# (name pattern, value or function of the old value). Only ints are rewritten; a value already
# smaller than the rule's is kept (a 2-expert config stays 2 experts).
_Rule = Tuple[str, Any]
RULES: List[_Rule] = [
    (r"^hidden_size_per_layer_input$", 8),  # not vocab_size_per_layer_input: that one indexes by token id
    (r"vocab_size", VOCAB),
    (r"key_value_heads|kv_heads|num_kv", KV_HEADS),
    (r"(^|_)(num_)?(attention_)?heads$|^n_head$|_attention_heads$|^num_heads$|^n_heads$", HEADS),
    (r"head_dim$|^d_kv$|^kv_channels$|_head_dim$", HEAD_DIM),
    (r"^rotary_dim$", HEAD_DIM // 2),  # GPT-J, CodeGen: at most the head dim
    (r"(^|_)(lora_rank|kv_lora_rank|q_lora_rank)$", 16),
    (r"experts_per_tok(en)?$|^top_k$|^moe_topk$|^moe_k$|^num_selected_experts$|^topk_group$|^n_group$", 2),
    (r"(^|_)(num_)?(local_|routed_)?experts$|^n_routed_experts$|^moe_num_experts$", 4),
    (r"shared_experts$", 1),
    (r"moe_intermediate_size$|expert_intermediate_size$|shared_expert_intermediate_size$", 2 * HIDDEN),
    (r"intermediate_size$|^ffn_dim$|_ffn_dim$|^d_ff$|^n_inner$|^ffn_hidden_size$|^mlp_dim$", 2 * HIDDEN),
    (r"(^|_)(num_)?(hidden_|decoder_|encoder_)?layers$|^n_layer$|^num_blocks$|^n_layers$", LAYERS),
    (r"^hidden_size$|^d_model$|^n_embd$|^n_embed$|^embed_dim$|^dim$|^hidden_dim$|^model_dim$|^d_embed$|^emb_dim$|"
     r"^lru_width$", HIDDEN),
    (r"(^|_)dt_rank$|^adapter_rank$", 8),
    (r"_hidden_size$|_embed_dim$|^text_hidden_size$|^projection_dim$", HIDDEN),
    (r"max_position_embeddings$|^n_positions$|^n_ctx$|^max_seq_len$|^seq_length$", 128),
    (r"^image_size$", 32),
    (r"^patch_size$", 8),
    (r"num_codebooks$", 2),
    # Mamba-2 mixers (Mamba2, Bamba, Falcon-H1, Granite 4, Zamba2): small states, one group (groups divide heads)
    (r"^state_size$|^mamba_d_state$|^ssm_state_size$", 16),
    (r"^n_groups$|^mamba_n_groups$|^mamba_ngroups$", 1),
    # Jamba-style hybrids: attention every ``period`` layers from ``offset``; 2 layers keep one of each kind.
    (r"^attn_layer_period$", 2),
    (r"^attn_layer_offset$", 1),
]
_COMPILED = [(re.compile(pattern), value) for pattern, value in RULES]

# Lists sized by the layer count; __init__ rebuilds them from the shrunk count.
_DERIVED_LISTS = re.compile(r"layer_types$|^layers_block_type$|^block_types$|^attn_layer_|_layer_indices$|"
                            r"^mlp_only_layers$|^swa_layers$|^layer_pattern$|^full_attention_idx$")
# Sizes __init__ derives from other sizes (DeepSeek's qk_head_dim = nope + rope head dims): dropped.
_DERIVED_SIZES = frozenset({"qk_head_dim"})
_TOKEN_ID = re.compile(r"token_id$|token_ids$")
# Sizes a default config leaves unset (None) that its model needs all the same, set the way real checkpoints do:
# a mixture of experts without a top-k (DeepSeek-V2), a head dim or a key/value head count left to the model
# (Ministral, HunYuan, Nemotron read them without a fallback); None keeps its meaning elsewhere.
_UNSET_SIZES = {"num_experts_per_tok": 2, "head_dim": HEAD_DIM, "num_key_value_heads": HEADS}
# A Mamba-2 mixer's sizes are tied: heads x head dim = expand x hidden (its config validates it, and Falcon-H1
# keeps the product as mamba_d_ssm). (expand, heads, head dim) key names, per family.
_MAMBA2_SIZES = (("expand", "num_heads", "head_dim"), ("mamba_expand", "mamba_n_heads", "mamba_d_head"),
                 ("mamba_expand", "n_mamba_heads", "mamba_headdim"))


def _shrink_value(key: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    for pattern, new in _COMPILED:
        if pattern.search(key):
            target = new(value) if callable(new) else new
            return min(value, target) if value > 0 else value
    return value


def _fix_token_ids(values: Dict[str, Any]) -> None:
    # A composite config keeps its special ids at the top and the vocabulary in its text config.
    nested = [v.get("vocab_size") for v in values.values() if isinstance(v, dict)]
    sizes = [v for v in [values.get("vocab_size"), *nested] if isinstance(v, int) and not isinstance(v, bool)]
    vocab = sizes[0] if "vocab_size" in values and sizes else min(sizes, default=VOCAB)
    for key, value in list(values.items()):
        if not _TOKEN_ID.search(str(key)):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            # spread over the top 16 ids (a deterministic function of the name: both legs build the same config)
            values[key] = vocab - 1 - (zlib.crc32(str(key).encode()) % 16)
        elif isinstance(value, list):
            values[key] = [v if not isinstance(v, int) or v < vocab else vocab - 1 - i for i, v in enumerate(value)]


def _generation_defaults() -> Dict[str, Any]:
    """generate()'s defaults that transformers 4.x keeps on every config (``top_k=50``...): they size
    nothing, and ``top_k`` shrunk to 2 beside ``do_sample=False`` makes save_pretrained refuse the
    model's generation config."""
    from transformers import PretrainedConfig

    getter = getattr(PretrainedConfig, "_get_global_generation_defaults", None)
    return dict(getter()) if callable(getter) else {}


def _one_layer_of_each_kind(value: Any) -> Any:
    """``layer_types`` of several kinds (linear and full attention, sliding and full), cut to one layer of
    each kind in order of first appearance: left to ``__init__``, two layers of a hybrid come out all
    linear attention (Qwen3-Next, Qwen3.5, Kimi-Linear: generate() then fails in memory) or all sliding
    (Gemma 2/3: the full-attention layers go unmeasured). None where the kinds do not fit in ``LAYERS``."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        kinds = list(dict.fromkeys(value))
        if 1 < len(kinds) <= LAYERS:
            return kinds + [kinds[0]] * (LAYERS - len(kinds))
    return None


def shrink_dict(values: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    generation = _generation_defaults()
    for key, value in values.items():
        if key in generation and value == generation[key]:
            out[key] = value
            continue
        if key == "use_mamba_kernels":  # CUDA-only kernels (transformers 4.x Jamba): the sweep runs on CPU
            out[key] = False
            continue
        if key == "layer_types" and _one_layer_of_each_kind(value) is not None:
            out[key] = _one_layer_of_each_kind(value)
            continue
        if isinstance(value, (list, tuple, dict)) and (_DERIVED_LISTS.search(str(key)) or "layer" in str(key)):
            continue  # sized or keyed by the layer count (layer_types, per_layer_config): __init__ derives it again
        if isinstance(value, dict) and ("model_type" in value or str(key).endswith("config") or key in ("encoder", "decoder")):
            out[key] = shrink_dict(value)
        else:
            out[key] = _shrink_value(str(key), value)
    for key in _DERIVED_SIZES:
        out.pop(key, None)
    _fill_unset_sizes(values, out)
    _tie_mamba2_sizes(out)
    # Multi-head (or DeepSeek's latent) attention has as many key/value heads as heads: keep it so.
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and heads == kv and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    _fix_token_ids(out)
    return out


def _fill_unset_sizes(values: Dict[str, Any], out: Dict[str, Any]) -> None:
    for key, size in _UNSET_SIZES.items():
        if key in values and values[key] is None:
            out[key] = size
    # a hybrid whose attention layers are listed by index (Bamba: none by default; Zamba2: none below layer 6):
    # the last layer attends
    for key in ("attn_layer_indices", "hybrid_layer_ids"):
        if key in values and (values[key] is None or not any(i < LAYERS for i in values[key])):
            out[key] = [LAYERS - 1]


def _tie_mamba2_sizes(out: Dict[str, Any]) -> None:
    hidden = out.get("hidden_size")
    for expand_key, heads_key, head_dim_key in _MAMBA2_SIZES:
        expand, heads = out.get(expand_key), out.get(heads_key)
        if head_dim_key in out and all(isinstance(v, int) and v > 0 for v in (hidden, expand, heads)):
            if (hidden * expand) % heads == 0:
                out[head_dim_key] = hidden * expand // heads
                if isinstance(out.get("mamba_d_ssm"), int):
                    out["mamba_d_ssm"] = hidden * expand


def tiny_config(config_class: Callable[..., Any]) -> Any:
    """The class's default config with every size shrunk (see the module docstring)."""
    default = config_class()
    values = shrink_dict(default.to_dict())
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        values.pop(key, None)
    try:
        return config_class(**values)
    except Exception:
        # Some __init__s reject their own to_dict(); shrink the attributes of the default instead.
        for key, value in values.items():
            current = getattr(default, key, None)
            if isinstance(value, dict) and hasattr(current, "to_dict"):
                try:
                    value = type(current)(**value)  # a sub-config: shrunk the same way
                except Exception:
                    continue
            elif isinstance(value, dict):
                continue
            try:
                setattr(default, key, value)
            except Exception:
                pass
        return default
