"""A lazy tensor meets an eagerly built one: gguf's LazyBase computes the meta stand-in with the eager
tensor as it is (on cpu) next to meta tensors.

This is what llama.cpp's convert_hf_to_gguf.py does in `dequant_bitnet` (an eager shift tensor
applied to a lazy packed weight, a BitNet checkpoint): its LazyTorchTensor is built on
`gguf.lazy.LazyBase` like the minimal one below.

Fails with: RuntimeError
"""
import torch
from gguf.lazy import LazyBase


class LazyTorch(LazyBase):  # as convert_hf_to_gguf.py's LazyTorchTensor, reduced to what is needed
    _tensor_type = torch.Tensor

    @classmethod
    def meta_with_dtype_and_shape(cls, dtype, shape):
        return torch.empty(tuple(shape), dtype=dtype, device="meta")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return cls._wrap_fn(func)(*args, **(kwargs or {}))


def unpack(weight):  # dequant_bitnet's unpacking of four 2-bit fields per byte
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1, 1)  # always eager
    fields = torch.bitwise_right_shift(weight.unsqueeze(0).expand(4, *weight.shape), shift)
    return torch.sub(torch.bitwise_and(fields, 3).float(), 1.0).reshape(-1, weight.shape[1])


packed = torch.randint(0, 256, (8, 6), dtype=torch.uint8)
expected = unpack(packed)
result = LazyTorch.to_eager(unpack(LazyTorch.from_eager(packed)))  # Tensor on device cpu is not on ... meta!
assert torch.equal(result, expected), "the lazy result differs from the eager one"
print("ok: the lazy computation equals the eager one")
