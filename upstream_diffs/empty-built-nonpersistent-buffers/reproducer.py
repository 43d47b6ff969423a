"""from_pretrained leaves a custom module's non-persistent buffer as torch.empty_like memory: the model
is built on meta and _init_weights does not recompute this buffer. empty_like is filled with NaN here,
so the result is deterministic (uninitialised memory can by chance look right).

Fails with: AssertionError
"""
import sys
import tempfile

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

if Version(transformers.__version__) < Version("5"):
    print("not applicable: transformers 4 builds buffers on the CPU")
    sys.exit(77)


class TableConfig(PretrainedConfig):
    model_type = "reproducer-table"


class TableModel(PreTrainedModel):
    config_class = TableConfig

    def __init__(self, config):
        super().__init__(config)
        self.proj = nn.Linear(16, 8)
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, 16, 2).float() / 16)), persistent=False)
        self.post_init()

    def forward(self, x):
        return self.proj(x) * self.inv_freq


empty_like = torch.empty_like
torch.manual_seed(0)
model = TableModel(TableConfig()).eval()
x = torch.randn(2, 16)
with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    torch.empty_like = lambda *a, **k: empty_like(*a, **k).fill_(float("nan"))
    try:
        loaded = TableModel.from_pretrained(folder).eval()
    finally:
        torch.empty_like = empty_like
with torch.no_grad():
    assert torch.equal(loaded.inv_freq, model.inv_freq), loaded.inv_freq
    assert torch.equal(loaded(x), model(x))
print("ok")
