"""Reproducers for offloaded-outside-reads: model code that reads an offloaded module's tensors outside
that module's own forward.

``ReaderModel`` stands for the model code nobody here has read (a ``trust_remote_code`` model): a real
``PreTrainedModel`` saved and loaded with ``from_pretrained(device_map=..., offload_folder=...)``, whose
forward makes every kind of read the mechanism serves: ``input_ids.to(self.embed.weight.device)``,
``self.embed.weight[pad_token_id]``, ``self.norm.bias`` added outside the norm, and a child's method other
than ``forward`` (``self.experts.mix(x)``, whose body reads the experts' own weight). With ``embed``,
``experts`` and ``norm`` on disk, upstream fails (``Cannot copy out of meta tensor``); fixed means logits
and greedy ``generate()`` equal the in-memory model's (torch.equal). The maps' memory entries and the
reference are on the execution device (``_device``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._device import main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, max_abs_diff

PATCH_ID = "offloaded-outside-reads"
_NEW_TOKENS = 4
_VOCAB = 64
_DEVICE_MAP = {"embed": "disk", "experts": "disk", "norm": "disk", "head": "cpu"}


def reader_classes() -> Any:
    """(config class, model class), built on first use: torch and transformers are imported here."""
    import torch
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class ReaderConfig(PretrainedConfig):
        model_type = "metapatch-reader"

        def __init__(self, vocab_size: int = _VOCAB, hidden_size: int = 16, num_experts: int = 3, **kwargs: Any):
            self.vocab_size, self.hidden_size, self.num_experts = vocab_size, hidden_size, num_experts
            kwargs.setdefault("pad_token_id", 0)
            super().__init__(**kwargs)

    class Experts(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(config.num_experts, config.hidden_size, config.hidden_size) * 0.1)

        def mix(self, x: Any) -> Any:  # called by the parent instead of forward: no accelerate hook runs
            return torch.einsum("bsh,ehk->bsk", x, self.weight) / self.weight.shape[0]

    class ReaderModel(PreTrainedModel, GenerationMixin):
        config_class = ReaderConfig
        base_model_prefix = "reader"
        _no_split_modules: list = []

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.experts = Experts(config)
            self.norm = torch.nn.LayerNorm(config.hidden_size)
            self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)
            self.post_init()

        def _init_weights(self, module: Any) -> None:
            pass  # the constructors' random values are the weights

        def get_input_embeddings(self) -> Any:
            return self.embed

        def forward(self, input_ids: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
            input_ids = input_ids.to(self.embed.weight.device)
            x = self.embed(input_ids) - self.embed.weight[self.config.pad_token_id]
            x = x + self.experts.mix(x)
            return CausalLMOutput(logits=self.head(self.norm(x) + self.norm.bias))

        def prepare_inputs_for_generation(self, input_ids: Any, **kwargs: Any) -> Dict[str, Any]:
            return {"input_ids": input_ids}

    return ReaderConfig, ReaderModel


def _in_memory(device_map: Dict[str, str]) -> Dict[str, Any]:
    """``device_map`` with its memory entries on the execution device."""
    return {name: main_device() if device == "cpu" else device for name, device in device_map.items()}


def _equal(got: Any, expected: Any) -> bool:
    import torch

    return torch.equal(got.cpu(), expected.cpu())


def _reference_and_offloaded(classes: Any, workdir: Path, device_map: Dict[str, str]) -> Any:
    """(the random in-memory model on the execution device, the same checkpoint loaded with ``device_map``
    (memory entries on the execution device) and an offload folder)."""
    import torch

    config_class, model_class = classes
    torch.manual_seed(0)
    reference = model_class(config_class()).eval()
    reference.save_pretrained(workdir / "ckpt")
    loaded = model_class.from_pretrained(workdir / "ckpt", device_map=_in_memory(device_map),
                                         offload_folder=str(workdir / "offload")).eval()
    return to_device(reference), loaded


def remote_code_reads(workdir: Path) -> Dict[str, Any]:
    """ReaderModel with embed, experts and norm on disk: every read outside the owner's forward."""
    import torch

    reference, loaded = _reference_and_offloaded(reader_classes(), workdir, _DEVICE_MAP)
    if not (loaded.embed.weight.is_meta and loaded.experts.weight.is_meta):
        raise AssertionError("the device map was meant to put embed and experts on disk")
    ids = device_input_ids(vocab_size=_VOCAB, length=8)
    kwargs = dict(max_new_tokens=_NEW_TOKENS, min_new_tokens=_NEW_TOKENS, do_sample=False, pad_token_id=0, use_cache=False)
    with torch.no_grad():
        got, expected = loaded(input_ids=ids).logits, reference(input_ids=ids).logits
        if not _equal(got, expected):
            raise AssertionError(f"logits differ: max abs diff {max_abs_diff(got, expected)}")
        tokens, expected_tokens = loaded.generate(ids, **kwargs), reference.generate(ids, **kwargs)
        if not _equal(tokens, expected_tokens):
            raise AssertionError(f"generate() gave {tokens.tolist()}, in memory {expected_tokens.tolist()}")
    if not (loaded.embed.weight.is_meta and loaded.experts.weight.is_meta):
        raise AssertionError("the offloaded weights stayed loaded after the forward")
    return {"max_abs_diff": 0.0}


# ProphetNet's decoder with its position, ngram and layer-norm units on disk (the sweep found it with every
# unit but the layers there). The tied word embeddings and head stay in memory: on disk, transformers < 5.13
# fails first on their missing disk-index entry (tied-device-map-disk-index's bug).
_PROPHETNET_MAP = {"prophetnet.word_embeddings": "cpu", "prophetnet.decoder.word_embeddings": "cpu",
                   "prophetnet.decoder.position_embeddings": "disk", "prophetnet.decoder.ngram_embeddings": "disk",
                   "prophetnet.decoder.embeddings_layer_norm": "disk", "prophetnet.decoder.layers": "cpu",
                   "lm_head": "cpu"}


def prophetnet_decoder_on_disk(workdir: Path) -> Dict[str, Any]:
    """ProphetNetForCausalLM with the decoder's position/ngram embeddings on disk: its forward reads
    ``self.ngram_embeddings.weight`` and calls ``self.position_embeddings._forward(...)``, a method whose
    body reads the embedding's own weight through ``super().forward`` (no ``self.weight`` to find)."""
    import torch

    try:
        from transformers import ProphetNetConfig, ProphetNetForCausalLM
    except ImportError as exc:
        from . import NotApplicable

        raise NotApplicable(f"needs ProphetNetForCausalLM ({exc})") from None
    config = ProphetNetConfig(vocab_size=_VOCAB, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=2,
                              num_decoder_attention_heads=2, max_position_embeddings=64, ngram=2, num_buckets=8,
                              relative_max_distance=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              decoder_start_token_id=0)
    torch.manual_seed(0)
    reference = ProphetNetForCausalLM(config).eval()
    reference.save_pretrained(workdir / "ckpt")
    loaded = ProphetNetForCausalLM.from_pretrained(workdir / "ckpt", device_map=_in_memory(_PROPHETNET_MAP),
                                                   offload_folder=str(workdir / "offload")).eval()
    decoder = loaded.prophetnet.decoder
    if not (decoder.position_embeddings.weight.is_meta and decoder.ngram_embeddings.weight.is_meta):
        raise AssertionError("the device map was meant to put the decoder's embeddings on disk")
    ids = device_input_ids(vocab_size=_VOCAB, length=8)
    with torch.no_grad():
        got, expected = loaded(input_ids=ids).logits, to_device(reference)(input_ids=ids).logits
    if not _equal(got, expected):
        raise AssertionError(f"logits differ: max abs diff {max_abs_diff(got, expected)}")
    if not decoder.position_embeddings.weight.is_meta:
        raise AssertionError("the position embedding stayed loaded after the forward")
    return {"max_abs_diff": 0.0}


# LongcatFlash's router computes its logits with F.linear(hidden, self.classifier.weight) instead of calling
# self.classifier: with its decoder layer on disk, the classifier (an nn.Linear with its own offload hook) still
# holds its meta placeholder there, and torch's CPU F.linear over a meta weight returns uninitialised memory
# instead of raising (torch 2.13): random routing, logits off or NaN.
_LONGCAT_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                "model.norm": "cpu", "lm_head": "cpu"}


def longcat_router_on_disk(workdir: Path) -> Dict[str, Any]:
    """LongcatFlashForCausalLM with its second decoder layer on disk: the router's direct read of its
    classifier's weight gets the real weight; router logits and logits of two forwards equal the in-memory
    model's (torch.equal)."""
    import torch

    try:
        from transformers import LongcatFlashConfig, LongcatFlashForCausalLM
    except ImportError as exc:
        from . import NotApplicable

        raise NotApplicable(f"needs LongcatFlashForCausalLM ({exc})") from None
    config = LongcatFlashConfig(vocab_size=_VOCAB, hidden_size=32, num_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, ffn_hidden_size=64, q_lora_rank=16, kv_lora_rank=16,
                                qk_nope_head_dim=16, qk_rope_head_dim=16, head_dim=16, v_head_dim=16,
                                n_routed_experts=4, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=32,
                                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    reference = LongcatFlashForCausalLM(config).eval()
    reference.save_pretrained(workdir / "ckpt")
    loaded = LongcatFlashForCausalLM.from_pretrained(workdir / "ckpt", device_map=_in_memory(_LONGCAT_MAP),
                                                     offload_folder=str(workdir / "offload")).eval()
    router = loaded.model.layers[1].mlp.router
    if not router.classifier.weight.is_meta:
        raise AssertionError("the device map was meant to put the second layer's router on disk")
    reference = to_device(reference)
    seen: Dict[str, Any] = {}

    def keep_first(tag: str) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:  # returns None: the output is left as it is
            seen.setdefault(tag, out[0].detach().clone())
        return hook

    for tag, model in (("expected", reference), ("got", loaded)):
        model.model.layers[1].mlp.router.register_forward_hook(keep_first(tag))
    ids = device_input_ids(vocab_size=_VOCAB, length=8)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got, again = loaded(input_ids=ids).logits, loaded(input_ids=ids).logits
    nan = int(got.isnan().sum())
    if not _equal(seen["got"], seen["expected"]):
        raise AssertionError(f"router logits differ: max abs diff {max_abs_diff(seen['got'], seen['expected'])} "
                             f"(logits max abs diff {max_abs_diff(got, expected)}, {nan} NaN of {got.numel()})")
    if not (_equal(got, expected) and _equal(again, expected)):
        raise AssertionError(f"logits differ: max abs diff {max(max_abs_diff(got, expected), max_abs_diff(again, expected))}, "
                             f"{nan} NaN of {got.numel()}")
    if not router.classifier.weight.is_meta:
        raise AssertionError("the router's classifier stayed loaded after the forward")
    return {"max_abs_diff": 0.0, "nan": nan}


# ZayaModel's shape (the sweep found it): a base module with parameters of its own beside its children,
# one of them mapped to disk under its own key, its sibling in memory.
_SPLIT_MAP = {"model.scale": "disk", "model.bias": "cpu", "model.embed": "cpu", "model.layer": "cpu", "head": "cpu"}


def split_classes() -> Any:
    """(config class, model class) of a model whose base holds tensors of its own beside its children."""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class SplitConfig(PretrainedConfig):
        model_type = "metapatch-split"

        def __init__(self, vocab_size: int = _VOCAB, hidden_size: int = 16, **kwargs: Any):
            self.vocab_size, self.hidden_size = vocab_size, hidden_size
            super().__init__(**kwargs)

    class Base(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.scale = torch.nn.Parameter(torch.rand(config.hidden_size) + 0.5)
            self.bias = torch.nn.Parameter(torch.randn(config.hidden_size))
            self.layer = torch.nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, input_ids: Any) -> Any:
            return self.layer((self.embed(input_ids) + self.bias) * self.scale)

    class SplitModel(PreTrainedModel):
        config_class = SplitConfig
        base_model_prefix = "model"
        _no_split_modules: list = []

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = Base(config)
            self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)
            self.post_init()

        def _init_weights(self, module: Any) -> None:
            pass  # the constructors' random values are the weights

        def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
            return CausalLMOutput(logits=self.head(self.model(input_ids)))

    return SplitConfig, SplitModel


def own_tensor_mapped_alone(workdir: Path) -> Dict[str, Any]:
    """A base module's own parameter mapped to disk under its own key, its sibling on cpu: accelerate hooks
    modules, so nothing loads that parameter and the base's forward computes on the placeholder."""
    import torch

    reference, loaded = _reference_and_offloaded(split_classes(), workdir, _SPLIT_MAP)
    if not loaded.model.scale.is_meta:
        raise AssertionError("the device map was meant to put model.scale on disk")
    ids = device_input_ids(vocab_size=_VOCAB, length=8)
    with torch.no_grad():
        got, expected = loaded(input_ids=ids).logits, reference(input_ids=ids).logits
        again = loaded(input_ids=ids).logits
    if not (_equal(got, expected) and _equal(again, expected)):
        raise AssertionError(f"logits differ: max abs diff {max_abs_diff(got, expected)}")
    if not loaded.model.scale.is_meta:
        raise AssertionError("the offloaded parameter stayed loaded after the forward")
    return {"max_abs_diff": 0.0}


def writer_classes() -> Any:
    """(config class, model class) of a model whose forward reads a child's weight and writes it through
    ``.data`` (an in-place update that bumps no ``_version``: a running scale, an EMA codebook)."""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class WriterConfig(PretrainedConfig):
        model_type = "metapatch-writer"

        def __init__(self, vocab_size: int = _VOCAB, hidden_size: int = 16, **kwargs: Any):
            self.vocab_size, self.hidden_size = vocab_size, hidden_size
            super().__init__(**kwargs)

    class Scales(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.rand(config.hidden_size) + 0.5)

    class WriterModel(PreTrainedModel):
        config_class = WriterConfig
        base_model_prefix = "writer"
        _no_split_modules: list = []

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.scales = Scales(config)
            self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)
            self.post_init()

        def _init_weights(self, module: Any) -> None:
            pass  # the constructors' random values are the weights

        def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
            logits = self.head(self.embed(input_ids) * self.scales.scale)
            self.scales.scale.data.mul_(0.5)  # persists in memory: the next call computes with it
            return CausalLMOutput(logits=logits)

    return WriterConfig, WriterModel


def held_write_through_data(workdir: Path) -> Dict[str, Any]:
    """WriterModel with its scales on disk, three calls under torch.inference_mode: each equals the in-memory
    model's (the write through ``.data`` into the held weight is kept by the offload store, not dropped)."""
    import torch

    reference, loaded = _reference_and_offloaded(writer_classes(), workdir, {"embed": "cpu", "scales": "disk",
                                                                              "head": "cpu"})
    if not loaded.scales.scale.is_meta:
        raise AssertionError("the device map was meant to put scales on disk")
    ids = device_input_ids(vocab_size=_VOCAB, length=8)
    worst = 0.0
    with torch.inference_mode():
        for call in range(3):
            got, expected = loaded(input_ids=ids).logits, reference(input_ids=ids).logits
            if not _equal(got, expected):
                worst = max(worst, max_abs_diff(got, expected))
    if worst:
        raise AssertionError(f"logits differ after the held weight was written: max abs diff {worst}")
    if not loaded.scales.scale.is_meta:
        raise AssertionError("the offloaded weight stayed loaded after the forward")
    return {"max_abs_diff": 0.0}


def llava_next_image_features(workdir: Path) -> Dict[str, Any]:
    """LLaVA-NeXT with its base model's own parameter ``image_newline`` on disk (the rest on the execution device).
    ``get_image_features`` reads it (through ``pack_image_features``) outside the base model's forward, the only
    place its hook loads it: called by the user, and by ``generate()`` before the first forward (transformers
    >= 5.2x, ``_prepare_multimodal_encoder_kwargs_for_generation``)."""
    import torch

    from ._vision_language import llava_next_inputs, tensors, tiny_llava_next

    model_class, config = tiny_llava_next()
    torch.manual_seed(0)
    reference = model_class(config).eval()
    reference.save_pretrained(workdir / "ckpt")
    device_map = {"model.image_newline": "disk", "model.vision_tower": "cpu", "model.multi_modal_projector": "cpu",
                  "model.language_model": "cpu", "lm_head": "cpu"}
    loaded = model_class.from_pretrained(workdir / "ckpt", device_map=_in_memory(device_map),
                                         offload_folder=str(workdir / "offload")).eval()
    reference = to_device(reference)
    if not loaded.model.image_newline.is_meta:
        raise AssertionError("the device map was meant to put model.image_newline on disk")
    inputs = {name: to_device(value) for name, value in llava_next_inputs().items()}
    images = dict(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
    with torch.no_grad():
        got, expected = tensors(loaded.get_image_features(**images)), tensors(reference.get_image_features(**images))
        if not got or len(got) != len(expected) or not all(_equal(g, e) for g, e in zip(got, expected)):
            raise AssertionError("image features differ from the in-memory model's")
        tokens = loaded.generate(**inputs, max_new_tokens=_NEW_TOKENS, do_sample=False, pad_token_id=0)
        reference_tokens = reference.generate(**inputs, max_new_tokens=_NEW_TOKENS, do_sample=False, pad_token_id=0)
    if not _equal(tokens, reference_tokens):
        raise AssertionError(f"greedy tokens differ: {tokens.tolist()} != {reference_tokens.tolist()}")
    if not loaded.model.image_newline.is_meta:
        raise AssertionError("the offloaded parameter stayed loaded after get_image_features")
    return {"max_abs_diff": 0.0}


SCENARIOS = [
    Scenario(PATCH_ID, "prophetnet-decoder-embeddings-on-disk", f"{__name__}:prophetnet_decoder_on_disk",
             "ProphetNetForCausalLM with its decoder's position/ngram embeddings and layer norm on disk: its decoder reads "
             "ngram_embeddings.weight and calls position_embeddings._forward() (super().forward on the embedding's "
             "own weight) outside those modules' forwards; logits equal the in-memory model (unpatched: "
             "RuntimeError 'Tensor on device meta is not on the expected device'). Found by the sweep",
             expected_error="RuntimeError", expected_message="Tensor on device meta is not on the expected device"),
    Scenario(PATCH_ID, "longcat-router-on-disk", f"{__name__}:longcat_router_on_disk",
             "LongcatFlashForCausalLM with its second decoder layer on disk: the router computes F.linear(hidden, "
             "self.classifier.weight) outside the classifier's forward; router logits and logits of two forwards equal "
             "the in-memory model (unpatched on CPU: no error, torch's F.linear over the meta placeholder returns "
             "uninitialised memory, so the routing is random and the logits off or NaN). Found by the sweep",
             expected_error="AssertionError", expected_message="router logits differ",
             requires={"transformers": ">=5.7.0"}),
    Scenario(PATCH_ID, "own-parameter-mapped-alone-on-disk", f"{__name__}:own_tensor_mapped_alone",
             "a base module's own parameter mapped to disk under its own key beside a sibling on cpu (ZayaModel's "
             "input_hidden_states_scale, found by the sweep): accelerate hooks modules, so nothing loads it; logits "
             "of two forwards equal the in-memory model (unpatched: RuntimeError 'Tensor on device meta is not on "
             "the expected device')",
             expected_error="RuntimeError", expected_message="Tensor on device meta is not on the expected device"),
    Scenario(PATCH_ID, "remote-code-reads-on-disk", f"{__name__}:remote_code_reads",
             "a remote-code-style model reading embed.weight[pad], embed.weight.device, norm.bias and calling "
             "experts.mix() from its forward, with those modules on disk: logits and greedy generate() equal the "
             "in-memory model (unpatched: NotImplementedError 'Cannot copy out of meta tensor')",
             expected_error="NotImplementedError", expected_message="Cannot copy out of meta tensor"),
    Scenario(PATCH_ID, "held-write-through-data-on-disk", f"{__name__}:held_write_through_data",
             "a model whose forward reads a child's weight on disk and writes it through .data under "
             "torch.inference_mode: three calls equal the in-memory model's (the write is kept by the offload "
             "store; before, it was dropped at the next offload; unpatched: the read meets the meta placeholder)",
             expected_error="RuntimeError|NotImplementedError"),
    Scenario(PATCH_ID, "llava-next-image-features-on-disk", f"{__name__}:llava_next_image_features",
             "LlavaNextForConditionalGeneration with its base model's own image_newline on disk: get_image_features "
             "(the user's call, and generate()'s before its first forward on transformers >= 5.2x) reads it outside "
             "the base model's forward; image features and greedy generate() equal the in-memory model (unpatched: "
             "NotImplementedError 'Cannot copy out of meta tensor'). Found by a VLM survey of offload placements",
             expected_error="NotImplementedError", expected_message="Cannot copy out of meta tensor"),
]
