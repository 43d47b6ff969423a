"""After one torch.no_grad() evaluation, a 4-bit layer no longer back-propagates, and its state dict
changed: bitsandbytes repacks the weight in place for its CPU kernel (CPUs with AVX512-BF16).

Linear4bit.forward repacks at the first eval-mode forward whose input needs no grad; the repacked
kernel (bitsandbytes::gemv_4bit) has no autograd kernel, so the input of a later training forward
gets no gradient (QLoRA adapters below the layer: grad None), and _save_to_state_dict converts the
repacked state back lossily (absmax through bfloat16).

The repack runs where bitsandbytes detects AVX512-BF16; it is forced here so that the reproducer shows
the bug on any CPU (the forced flag is what Linear4bit sets from has_avx512bf16()).

Fails with: AssertionError
"""
import copy

import bitsandbytes as bnb
import torch
from bitsandbytes.functional import has_avx512bf16

print("CPU repack path:", bool(has_avx512bf16()))
torch.manual_seed(0)
layer = bnb.nn.Linear4bit(64, 64, bias=False, compress_statistics=True, quant_type="nf4").to("cpu")
layer.support_avx512bf16_for_cpu = True
fresh = copy.deepcopy(layer)
loaded = {k: v.clone() for k, v in layer.state_dict().items()}
x = torch.randn(2, 64)

layer.eval()
with torch.no_grad():
    layer(x)  # an evaluation
saved = layer.state_dict()
changed = [k for k in loaded if loaded[k].dtype != saved[k].dtype or not torch.equal(loaded[k], saved[k])]

layer.train()
grads = []
for module in (layer, fresh):
    inp = x.clone().requires_grad_(True)
    module(inp).sum().backward()
    grads.append(inp.grad)
assert grads[0] is not None, "no gradient through the 4-bit layer after one no_grad forward"
assert torch.equal(grads[0], grads[1]), "the gradient differs from a layer never evaluated"
assert not changed, f"state_dict() after one forward differs from what was quantized: {changed}"
print("ok: the evaluated layer trains and saves like a fresh one")
