"""init_empty_weights(include_buffers=True) then load_checkpoint_and_dispatch: a non-persistent buffer
(never in a checkpoint) stays on meta and dispatch fails.

Fails with: NotImplementedError
Affected: diff
"""
import tempfile

import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from safetensors.torch import save_file
from torch import nn


class Table(nn.Module):
    def __init__(self, dim, base=100.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x):
        return x * self.inv_freq


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim // 2)
        self.table = Table(dim)

    def forward(self, x):
        return self.table(self.proj(x))


torch.manual_seed(0)
model = Model(16).eval()
x = torch.randn(2, 16)
with torch.no_grad():
    expected = model(x)
with tempfile.TemporaryDirectory() as folder:
    save_file(model.state_dict(), f"{folder}/model.safetensors")
    with init_empty_weights(include_buffers=True):
        empty = Model(16)
    assert empty.table.inv_freq.is_meta
    empty = load_checkpoint_and_dispatch(empty, f"{folder}/model.safetensors", device_map={"proj": "cpu", "table": "cpu"})
    with torch.no_grad():
        got = empty(x)
assert torch.equal(empty.table.inv_freq, model.table.inv_freq)
assert torch.equal(got, expected), (got - expected).abs().max()
print("ok")
