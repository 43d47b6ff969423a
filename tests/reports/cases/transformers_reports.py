"""Reproducers of reports about transformers models with offloaded or meta weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
import transformers

from _tiny import (LLAMA_DISK_MAP, LLAMA_EMBEDDING_ON_DISK, NotApplicable, assert_matches, cached, greedy, input_ids,
                   llama, logits, offload, require, save_random)


def _tiny_text(**extra: Any) -> Dict[str, Any]:
    values = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    values.update(extra)
    return values


def generate_inputs_to_model_device(workdir: Path) -> Dict[str, Any]:
    """diffusers#13096: Qwen2.5 with ``device_map="auto"``; the quickstart moves the prompt with
    ``.to(model.device)``, which is meta when the first parameter (the embedding) is offloaded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    ckpt = cached(workdir, "qwen2", lambda p: save_random(Qwen2ForCausalLM, Qwen2Config(**_tiny_text()), p))
    reference = greedy(Qwen2ForCausalLM.from_pretrained(ckpt).eval())
    model = Qwen2ForCausalLM.from_pretrained(ckpt, device_map=LLAMA_EMBEDDING_ON_DISK, offload_folder=offload(workdir))
    ids = input_ids().to(model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    if not torch.equal(out.cpu(), reference):
        raise AssertionError(f"generate with the embedding offloaded: outputs differ from the in-memory reference ({out} vs {reference})")
    return {"tokens": out.tolist()}


def resize_token_embeddings_offloaded(workdir: Path) -> Dict[str, Any]:
    """transformers#25554: ``resize_token_embeddings`` after loading with a device map that offloads
    the embedding and the head; logits of the old vocabulary must not change."""
    from transformers import LlamaForCausalLM

    ckpt = llama(workdir)
    reference = logits(LlamaForCausalLM.from_pretrained(ckpt).eval())
    device_map = dict(LLAMA_EMBEDDING_ON_DISK, lm_head="disk")
    model = LlamaForCausalLM.from_pretrained(ckpt, device_map=device_map, offload_folder=offload(workdir)).eval()
    model.resize_token_embeddings(136)
    got = logits(model)[..., :128]
    return {"max_abs_diff": assert_matches(got, reference, "logits after resize_token_embeddings")}


def gemma4_pad_embedding_offloaded(workdir: Path) -> Dict[str, Any]:
    """transformers PR #48409: Gemma 4 reads ``embed_tokens.weight[pad_token_id]`` outside the
    embedding's forward; with the embedding offloaded that is the meta placeholder."""
    require(transformers, "Gemma4ForCausalLM")
    from transformers import Gemma4ForCausalLM

    from metapatch.selftest._peft import offload_map, save_tiny_gemma4

    ckpt = cached(workdir, "gemma4", save_tiny_gemma4)
    reference = logits(Gemma4ForCausalLM.from_pretrained(ckpt).eval())
    device_map = dict(offload_map("gemma4", main="cpu"), **{"model.embed_tokens": "disk"})
    model = Gemma4ForCausalLM.from_pretrained(ckpt, device_map=device_map, offload_folder=offload(workdir)).eval()
    return {"max_abs_diff": assert_matches(logits(model), reference, "Gemma 4 with its embedding on disk")}


def linear_attention_offloaded(workdir: Path) -> Dict[str, Any]:
    """transformers PR #46978: linear-attention layers (Qwen3-Next's gated delta net) use their conv
    weights without calling the submodule's forward, so offloaded weights stayed meta. This reproducer
    computes on the torch fallback (cpu/disk map), which calls the conv module's forward: it shows the fix
    (5.17+) holding, and before 5.17 it cannot show the bug, which lives in the CUDA kernel path."""
    require(transformers, "Qwen3NextForCausalLM")
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.17.0"):
        raise NotApplicable(f"transformers {transformers.__version__} has the bug in the CUDA kernel path only "
                            "(causal-conv1d / flash-linear-attention); the torch fallback this reproducer takes "
                            "runs the conv module's forward and its offload hook")
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**_tiny_text(), head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32,
                             layer_types=["linear_attention", "full_attention"] * 2)
    ckpt = cached(workdir, "qwen3-next", lambda p: save_random(Qwen3NextForCausalLM, config, p))
    reference = logits(Qwen3NextForCausalLM.from_pretrained(ckpt).eval())
    model = Qwen3NextForCausalLM.from_pretrained(ckpt, device_map=LLAMA_DISK_MAP | {"model.layers.2": "disk", "model.layers.0": "disk"},
                                                 offload_folder=offload(workdir)).eval()
    return {"max_abs_diff": assert_matches(logits(model), reference, "linear attention on disk", tolerance=1e-4)}


def save_disk_offloaded_moe(workdir: Path) -> Dict[str, Any]:
    """transformers#47333: ``save_pretrained`` of a Qwen3 MoE model loaded with disk offload."""
    require(transformers, "Qwen3MoeForCausalLM")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**_tiny_text(), head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    ckpt = cached(workdir, "qwen3-moe", lambda p: save_random(Qwen3MoeForCausalLM, config, p))
    reference = logits(Qwen3MoeForCausalLM.from_pretrained(ckpt).eval())
    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, device_map=LLAMA_DISK_MAP, offload_folder=offload(workdir))
    model.save_pretrained(workdir / "saved")
    reloaded = Qwen3MoeForCausalLM.from_pretrained(workdir / "saved").eval()
    return {"max_abs_diff": assert_matches(logits(reloaded), reference, "saved from a disk-offloaded MoE", tolerance=1e-4)}


def tie_from_config_on_meta(workdir: Path) -> Dict[str, Any]:
    """transformers#43523 (fixing transformers#43522): ``_from_config`` under ``torch.device("meta")`` did not
    tie the embeddings, so ``lm_head.weight`` became a separate (meta) parameter."""
    from transformers import LlamaForCausalLM

    from _tiny import tiny_llama_config

    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(tiny_llama_config(tie_word_embeddings=True))
    names = [n for n, _ in model.named_parameters()]
    if "lm_head.weight" in names or model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("lm_head.weight is not tied to the embedding after _from_config on meta")
    return {"parameters": len(names)}


def move_meta_built_model(workdir: Path) -> Dict[str, Any]:
    """transformers#28972: a LLaVa model built on the meta device, then ``model.to(device)``."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                        num_attention_heads=2, image_size=32, patch_size=8),
                         text_config=LlamaConfig(**_tiny_text()))
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    model.to("cpu")
    return {}


def item_in_init_under_meta(workdir: Path) -> Dict[str, Any]:
    """OpenGVLab/VideoMAEv2#87: remote code computes ``[x.item() for x in torch.linspace(...)]`` in
    ``__init__``; ``from_pretrained`` builds every model on the meta device."""
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    class ReproConfig(PretrainedConfig):
        model_type = "videomae-v2-repro"

        def __init__(self, depth: int = 3, drop_path_rate: float = 0.1, **kwargs: Any) -> None:
            self.depth, self.drop_path_rate = depth, drop_path_rate
            super().__init__(**kwargs)

    class ReproModel(PreTrainedModel):
        config_class = ReproConfig

        def __init__(self, config: ReproConfig) -> None:
            super().__init__(config)
            rates = [x.item() for x in torch.linspace(0, config.drop_path_rate, config.depth)]
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in rates)
            self.post_init()

        def _init_weights(self, module: Any) -> None:
            pass

    path = workdir / "videomae"
    torch.manual_seed(0)
    ReproModel(ReproConfig()).save_pretrained(path)
    ReproModel.from_pretrained(path)
    return {}


def bloom_layers_on_disk(workdir: Path) -> Dict[str, Any]:
    """accelerate#512: BLOOM (tied embeddings) with on-disk layers: ``KeyError`` at inference."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=128, hidden_size=64, n_layer=3, n_head=4)
    ckpt = cached(workdir, "bloom", lambda p: save_random(BloomForCausalLM, config, p))
    reference = logits(BloomForCausalLM.from_pretrained(ckpt).eval())
    device_map = {"transformer.word_embeddings": "disk", "transformer.word_embeddings_layernorm": "cpu",
                  "transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.h.2": "disk",
                  "transformer.ln_f": "cpu", "lm_head": "disk"}
    model = BloomForCausalLM.from_pretrained(ckpt, device_map=device_map, offload_folder=offload(workdir)).eval()
    return {"max_abs_diff": assert_matches(logits(model), reference, "BLOOM with layers on disk")}


def t5_auto_map_tight_budget(workdir: Path) -> Dict[str, Any]:
    """adapter-hub/adapters#470 (accelerate#958): T5's tied ``shared`` / ``embed_tokens`` / head
    with ``device_map="auto"`` and a budget that forces a split crashed the device-map planning."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)
    ckpt = cached(workdir, "t5", lambda p: save_random(T5ForConditionalGeneration, config, p))
    ids, labels = input_ids(), input_ids(seed=2)[:, :4]
    with torch.no_grad():
        reference = T5ForConditionalGeneration.from_pretrained(ckpt).eval()(input_ids=ids, labels=labels).logits
    model = T5ForConditionalGeneration.from_pretrained(ckpt, device_map="auto", max_memory={"cpu": 60_000},
                                                       offload_folder=offload(workdir)).eval()
    with torch.no_grad():
        got = model(input_ids=ids, labels=labels).logits
    return {"max_abs_diff": assert_matches(got, reference, "T5 with device_map='auto' and a tight budget")}


def diffusion_gemma_auto_map(workdir: Path) -> Dict[str, Any]:
    """transformers#46566 (seed report 000): DiffusionGemma with ``device_map="auto"`` under a
    budget: weights left on meta, ``generate`` dies ``Tensor.item() cannot be called on meta``."""
    from metapatch.selftest.tied_device_map_transformers import auto_map_moderate_budget

    return auto_map_moderate_budget(workdir)


def gemma4_dispatch_skip_keys(workdir: Path) -> Dict[str, Any]:
    """transformers PR #45347: Gemma 4 under accelerate hooks; the hook's copy of the kwargs loses
    ``shared_kv_states`` unless it is in ``skip_keys`` (``KeyError: 22``)."""
    from metapatch.selftest.accelerate_dispatch_skip_keys import gemma4_dispatch_model

    return gemma4_dispatch_model(workdir)


def nonpersistent_buffer_from_pretrained(workdir: Path) -> Dict[str, Any]:
    """transformers#48892: a custom model's non-persistent buffer, not recomputed by ``_init_weights``,
    is ``empty_like`` memory after ``from_pretrained`` (filled with NaN here: uninitialised memory can
    by chance look right)."""
    from transformers import AutoModelForCausalLM

    from metapatch.selftest._models import nan_sentinel
    from metapatch.selftest.empty_built_nonpersistent_buffers import save_table_model

    reference = save_table_model(workdir / "table")
    with nan_sentinel():
        model = AutoModelForCausalLM.from_pretrained(workdir / "table").eval()
    ids = input_ids()
    return {"max_abs_diff": assert_matches(logits(model, ids), logits(reference, ids),
                                           "a custom model with a non-persistent buffer after from_pretrained")}


def mixtral_channels_last_offloaded(workdir: Path) -> Dict[str, Any]:
    """mlcommons/inference#1751: the Mixtral reference implementation loads with a device map that
    offloads, then calls ``model.to(memory_format=torch.channels_last)``: accelerate refuses any ``.to``
    of an offloaded model, though nothing would move."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_tiny_text(num_local_experts=4, num_experts_per_tok=2))
    ckpt = cached(workdir, "mixtral", lambda p: save_random(MixtralForCausalLM, config, p))
    reference = MixtralForCausalLM.from_pretrained(ckpt).eval().to(memory_format=torch.channels_last)
    model = MixtralForCausalLM.from_pretrained(ckpt, device_map=LLAMA_DISK_MAP, offload_folder=offload(workdir)).eval()
    model = model.to(memory_format=torch.channels_last)
    return {"max_abs_diff": assert_matches(logits(model), logits(reference), "Mixtral after .to(memory_format=...)")}


def deformable_detr_query_embeddings_offloaded(workdir: Path) -> Dict[str, Any]:
    """transformers#31560: DeformableDetrModel.forward reads ``query_position_embeddings.weight`` itself (the
    embedding's own forward never runs); with that embedding offloaded the read is the meta placeholder."""
    from transformers import DeformableDetrConfig, DeformableDetrModel, ResNetConfig

    backbone = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                            out_features=["stage2", "stage3", "stage4"])
    config = DeformableDetrConfig(use_timm_backbone=False, backbone_config=backbone, d_model=32, encoder_layers=1,
                                  decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=10, num_feature_levels=3,
                                  encoder_n_points=2, decoder_n_points=2)
    ckpt = cached(workdir, "deformable-detr", lambda p: save_random(DeformableDetrModel, config, p))
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))

    def hidden(model: Any) -> Any:
        with torch.no_grad():
            return model(pixel_values=pixels).last_hidden_state

    reference = DeformableDetrModel.from_pretrained(ckpt).eval()
    device_map = {name: "cpu" for name, _ in reference.named_children()}
    device_map.update({name: "cpu" for name, _ in reference.named_parameters(recurse=False)})  # level_embed
    device_map["query_position_embeddings"] = "disk"
    model = DeformableDetrModel.from_pretrained(ckpt, device_map=device_map, offload_folder=offload(workdir)).eval()
    return {"max_abs_diff": assert_matches(hidden(model), hidden(reference), "Deformable DETR, query embeddings on disk")}


def qwen3_5_moe_meta_to_empty(workdir: Path) -> Dict[str, Any]:
    """transformers#45902: ``Qwen3_5MoeTextRotaryEmbedding.inv_freq`` is uninitialised memory after building
    on the meta device and ``to_empty()`` (NaN cos/sin for the reporter); the weights are then loaded with
    torch's own ``load_state_dict``."""
    require(transformers, "Qwen3_5MoeForCausalLM")
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from metapatch.selftest._models import nan_sentinel

    config = Qwen3_5MoeTextConfig(**_tiny_text(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                               layer_types=["linear_attention", "full_attention"]))
    torch.manual_seed(0)
    reference = Qwen3_5MoeForCausalLM(config).eval()
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    with nan_sentinel():
        model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    return {"max_abs_diff": assert_matches(logits(model.eval()), logits(reference), "Qwen3.5-MoE after meta + to_empty")}


def textual_inversion_under_sequential_offload(workdir: Path) -> Dict[str, Any]:
    """diffusers#3922: ``pipe.enable_sequential_cpu_offload()`` then ``pipe.load_textual_inversion(...)``. The
    sequential offload is ``accelerate.cpu_offload`` on the text encoder (every weight a meta placeholder behind
    accelerate's hooks); loading the embedding resizes the token embeddings and writes the learned row through
    ``weight.data[token_id] = embedding``. The encoder's output for a prompt with the new token must equal the
    in-memory encoder's after the same two steps."""
    import accelerate
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=32)
    ckpt = cached(workdir, "clip-text", lambda p: save_random(CLIPTextModel, config, p))
    learned = torch.linspace(-1.0, 1.0, 64)

    def load_textual_inversion(encoder: Any) -> None:
        encoder.resize_token_embeddings(129)
        encoder.get_input_embeddings().weight.data[128] = learned

    ids = torch.tensor([[1, 5, 128, 7, 2]])
    reference = CLIPTextModel.from_pretrained(ckpt).eval()
    load_textual_inversion(reference)
    with torch.no_grad():
        expected = reference(ids).last_hidden_state
    encoder = CLIPTextModel.from_pretrained(ckpt).eval()
    accelerate.cpu_offload(encoder, execution_device="cpu")
    load_textual_inversion(encoder)
    with torch.no_grad():
        got = encoder(ids).last_hidden_state
    return {"max_abs_diff": assert_matches(got, expected, "text encoder output after load_textual_inversion")}
