"""A forward that reads an offloaded submodule's weight directly meets accelerate's meta placeholder.

`embed` is offloaded (disk offload of the whole model here); the parent's forward reads
`embed.weight[0]` and places its input by `embed.weight.device`, and calls `experts.mix()`, a method
other than forward: none of these run the owner's hook, so the weights are still on meta.

Fails with: NotImplementedError
Affected: diff
"""
import tempfile

import torch
from accelerate import disk_offload
from torch import nn


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4, 4))

    def mix(self, x):
        return torch.einsum("bsh,ehk->bsk", x, self.weight)


class Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.experts = Experts()

    def forward(self, ids):
        ids = ids.to(self.embed.weight.device)
        x = self.embed(ids) - self.embed.weight[0]
        return x + self.experts.mix(x)


torch.manual_seed(0)
model = Reader().eval()
ids = torch.tensor([[1, 2, 3]])
with torch.no_grad():
    expected = model(ids)
with tempfile.TemporaryDirectory() as folder:
    disk_offload(model, folder, execution_device="cpu")
    with torch.no_grad():
        got = model(ids)
    assert torch.equal(got, expected), (got - expected).abs().max()
    assert model.embed.weight.is_meta  # offloaded again after the forward
print("ok")
