"""Reproducer for gguf-lazy-eager-mix: a lazy torch tensor built on ``gguf.lazy.LazyBase`` (the way
llama.cpp's converter builds its ``LazyTorchTensor``) meets an eager tensor in one operation.

The arithmetic is BitNet's unpacking of 2-bit ternary weights, as ``convert_hf_to_gguf.py``'s
``dequant_bitnet`` does it: four 2-bit fields per uint8, shifted out with an eagerly built
``torch.tensor([0, 2, 4, 6], dtype=torch.uint8)``, minus one, divided by the (inverted) scale.
Upstream, the meta pass fails with torch's "Tensor on device cpu is not on the expected device
meta!"; fixed means the lazily computed result equals the eager one bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

from . import NotApplicable
from ._harness import Scenario

PATCH_ID = "gguf-lazy-eager-mix"


def lazy_torch_tensor_type() -> type:
    """A minimal lazy torch tensor on gguf's LazyBase: meta stand-ins on the meta device, and
    every torch function on it deferred through ``_wrap_fn``."""
    try:
        from gguf.lazy import LazyBase
    except ImportError as exc:
        raise NotApplicable(f"needs the gguf package ({exc})") from None
    import torch

    class LazyTorch(LazyBase):
        _tensor_type = torch.Tensor

        @classmethod
        def meta_with_dtype_and_shape(cls, dtype: Any, shape: Any) -> Any:
            return torch.empty(tuple(shape), dtype=dtype, device="meta")

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Tuple = (), kwargs: Any = None) -> Any:
            return cls._wrap_fn(func)(*args, **(kwargs or {}))

    return LazyTorch


def pack_ternary(ternary: Any) -> Any:
    """Pack a {-1, 0, 1} tensor of shape (4 * n, ...) into uint8 (n, ...): row ``k * n + i`` goes
    to bits ``2k, 2k+1`` of byte row ``i``, stored as value + 1 (the BitNet checkpoint layout that
    llama.cpp's dequant_bitnet reads)."""
    import torch

    quarter = ternary.shape[0] // 4
    fields = (ternary.to(torch.int16) + 1).reshape(4, quarter, *ternary.shape[1:])
    packed = fields[0] | (fields[1] << 2) | (fields[2] << 4) | (fields[3] << 6)
    return packed.to(torch.uint8)


def unpack_bitnet(weight: Any, scale: Any, *, functions: bool = False) -> Any:
    """dequant_bitnet-style unpacking, written against whatever tensor type it is given: the eager
    ``shift`` meets ``weight``, which is lazy in the lazy run. ``functions=True`` spells the shift
    and the subtraction as torch functions instead of operators (gguf <= 0.16.0 skips the meta pass
    for operators, so there only this spelling reaches it)."""
    import torch

    weight = weight.view(torch.uint8)
    shape = weight.shape
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape((4, *(1 for _ in shape)))
    expanded = weight.unsqueeze(0).expand((4, *shape))
    fields = torch.bitwise_right_shift(expanded, shift) if functions else expanded >> shift
    fields = fields & 3
    one = torch.ones((1,) * len(fields.shape), dtype=torch.float32)
    values = (torch.sub(fields.float(), one) if functions else fields.float() - 1).reshape((shape[0] * 4, *shape[1:]))
    return values / scale.float()


def bitnet_inputs(seed: int = 0, rows: int = 32, cols: int = 24) -> Tuple[Any, Any, Any]:
    """(ternary weights, packed uint8, bf16 scale of shape [1]) as the published checkpoints store
    them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ternary = torch.randint(-1, 2, (rows, cols), generator=generator).to(torch.float32)
    scale = torch.tensor([0.37], dtype=torch.bfloat16)
    return ternary, pack_ternary(ternary), scale


def lazy_unpack_matches_eager(workdir: Path) -> Dict[str, Any]:
    import torch

    lazy_type = lazy_torch_tensor_type()
    ternary, packed, scale = bitnet_inputs()
    eager = unpack_bitnet(packed, scale)
    # the unpacking itself must be right, or comparing lazy with eager proves nothing
    expected = ternary / scale.float()
    if not torch.equal(eager, expected) or not torch.equal(unpack_bitnet(packed, scale, functions=True), expected):
        raise AssertionError("eager unpacking does not give ternary / scale: the reproducer is wrong")
    for functions in (False, True):
        lazy = unpack_bitnet(lazy_type.from_eager(packed), lazy_type.from_eager(scale), functions=functions)
        if not isinstance(lazy, lazy_type):
            raise AssertionError(f"the lazy computation returned {type(lazy).__name__}, not a lazy tensor")
        result = lazy_type.to_eager(lazy)
        if result.dtype != eager.dtype or result.shape != eager.shape:
            raise AssertionError(f"lazy result {result.dtype} {tuple(result.shape)} != eager {eager.dtype} {tuple(eager.shape)}")
        mismatches = int((result != eager).sum())
        if mismatches:
            raise AssertionError(f"lazy result differs from the eager computation in {mismatches} elements")
    return {"max_abs_diff": float((result - eager).abs().max()), "elements": int(eager.numel())}


SCENARIOS = [
    Scenario(PATCH_ID, "bitnet-unpack", f"{__name__}:lazy_unpack_matches_eager",
             "dequant_bitnet-style unpacking of 2-bit weights on a gguf lazy torch tensor (with operators, "
             "as the converter writes it, and with torch functions) equals the eager result bit for bit "
             "(n/a without the gguf package)",
             expected_error="RuntimeError",
             expected_message="Tensor on device cpu is not on the expected device meta!", device="cpu",
             device_reason="llama.cpp's converter computes on the CPU: lazy meta stand-ins and eager CPU tensors, "
                           "no model on a device"),
]


# -- a tiny BitNet checkpoint for llama.cpp's converter (end-to-end tests) -----------------------

BITNET_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The sub-norms' names in transformers' BitNet (and microsoft/bitnet-b1.58-2B-4T), and the names
# llama.cpp's tensor map knows (1bitLLM's checkpoints); the converter maps only the latter.
LLAMA_CPP_SUB_NORM_NAMES = {"self_attn.attn_sub_norm.": "self_attn.inner_attn_ln.", "mlp.ffn_sub_norm.": "mlp.ffn_layernorm."}


def save_tiny_bitnet(directory: Path, seed: int = 0, *, llama_cpp_sub_norm_names: bool = False) -> Dict[str, Tuple[Any, Any]]:
    """A random ``BitNetForCausalLM`` stored the way microsoft/bitnet-b1.58-2B-4T is: every
    projection as packed uint8 ``weight`` (out/4 rows) plus a bf16 ``weight_scale`` of shape [1],
    ``quantization_config.quant_method == "bitnet"``, and a sentencepiece ``tokenizer.model``.
    Sizes are multiples of 256 so that ``--outtype tq2_0`` can pack the ternary tensors.
    ``llama_cpp_sub_norm_names`` renames the two sub-norms to what llama.cpp's converter maps.
    Returns {checkpoint tensor name: (ternary float tensor, bf16 scale)} for the projections."""
    import torch
    from safetensors.torch import save_file

    try:
        from transformers import BitNetConfig, BitNetForCausalLM
    except ImportError as exc:
        raise NotApplicable(f"needs transformers with BitNet ({exc})") from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _save_tiny_sentencepiece(directory)
    torch.manual_seed(seed)
    config = BitNetConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    config.architectures = ["BitNetForCausalLM"]
    config.quantization_config = {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                  "quantization_mode": "offline"}
    model = BitNetForCausalLM(config)
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(seed)
    tensors: Dict[str, Any] = {}
    ternaries: Dict[str, Tuple[Any, Any]] = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings, as in the published checkpoint
        if name.rsplit(".", 2)[-2] in BITNET_PROJECTIONS:
            ternary = torch.randint(-1, 2, tuple(value.shape), generator=generator).to(torch.float32)
            scale = torch.tensor([0.25 + 2 * torch.rand((), generator=generator).item()], dtype=torch.bfloat16)
            tensors[name] = pack_ternary(ternary)
            tensors[name + "_scale"] = scale
            ternaries[name] = (ternary, scale)
        else:
            if llama_cpp_sub_norm_names:
                for theirs, ours in LLAMA_CPP_SUB_NORM_NAMES.items():
                    name = name.replace(theirs, ours)
            tensors[name] = value.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return ternaries


def _save_tiny_sentencepiece(directory: Path) -> None:
    try:
        import sentencepiece
    except ImportError as exc:
        raise NotApplicable(f"needs sentencepiece for the BitNet tokenizer ({exc})") from None
    text = directory / "corpus.txt"
    words = ["lazy", "meta", "tensor", "device", "bitnet", "ternary", "weight", "scale", "pack", "unpack"]
    text.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(directory / "tokenizer"), vocab_size=64, model_type="bpe",
        character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    (directory / "tokenizer.vocab").unlink()
    text.unlink()
