"""from_pretrained leaves a custom module's non-persistent buffer as torch.empty_like memory.

transformers 5 builds the model on meta and materialises every non-persistent buffer with empty_like,
relying on _init_weights to recompute it; a buffer _init_weights does not know (remote-code rotary
tables) keeps the uninitialised memory. empty_like is filled with NaN here so the result is
deterministic (uninitialised memory can by chance look right).

Fails with: AssertionError
Affected: diff
"""
import sys
import tempfile

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from packaging.version import Version
import transformers

if Version(transformers.__version__) < Version("5"):
    print("not applicable: transformers 4 builds buffers on the CPU")
    sys.exit(77)


class TableConfig(PretrainedConfig):
    model_type = "reproducer-table"

    def __init__(self, dim=16, **kwargs):
        self.dim = dim
        super().__init__(**kwargs)


class Table(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)


class TableModel(PreTrainedModel):
    config_class = TableConfig

    def __init__(self, config):
        super().__init__(config)
        self.proj = nn.Linear(config.dim, config.dim // 2)
        self.table = Table(config.dim)
        self.post_init()

    def forward(self, x):
        return self.proj(x) * self.table.inv_freq


original_empty_like = torch.empty_like


def nan_empty_like(*args, **kwargs):
    value = original_empty_like(*args, **kwargs)
    return value.fill_(float("nan")) if value.is_floating_point() and not value.is_meta else value


torch.manual_seed(0)
model = TableModel(TableConfig()).eval()
x = torch.randn(2, 16)
with torch.no_grad():
    expected = model(x)
with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    torch.empty_like = nan_empty_like
    try:
        loaded = TableModel.from_pretrained(folder).eval()
    finally:
        torch.empty_like = original_empty_like
    with torch.no_grad():
        got = loaded(x)
assert torch.equal(loaded.table.inv_freq, model.table.inv_freq), loaded.table.inv_freq
assert torch.equal(got, expected), (got - expected).abs().max()
print("ok")
