"""A write into an offloaded parameter between forwards vanishes, silently; so does a forward's own write.

Layer 1 is offloaded to disk (a meta placeholder between forwards). Writing a row through ``.data`` (textual
inversion's write) and scaling the weight in place under ``no_grad`` are no-ops on the meta tensor, so the
next forward computes with the stored values; the in-memory model computes with the written ones.
Expected: equal outputs, or an error at the write.

Then BatchNorm offloaded with its buffers (``offload_buffers=True``) runs in training mode: the statistics its forward
updates in the loaded buffers are dropped after it. Expected: the evaluated model equal to the in-memory one.

Fails with: AssertionError
"""
import copy
import tempfile

import torch
from accelerate import dispatch_model
from accelerate.utils import offload_state_dict
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
reference = copy.deepcopy(model)
x = torch.randn(4, 8)


def write(m):
    m[1].weight.data[2] = torch.arange(8.0)
    with torch.no_grad():
        m[1].bias.mul_(0.5)


write(reference)
with tempfile.TemporaryDirectory() as folder:
    offload_state_dict(folder, {k: v for k, v in model.state_dict().items() if k.startswith("1.")})
    dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, offload_dir=folder)
    assert model[1].weight.is_meta
    try:
        write(model)
    except RuntimeError as error:  # a refusal is a fix too
        print("refused:", error)
    else:
        with torch.no_grad():
            assert torch.equal(model(x), reference(x)), "the writes into the offloaded layer were lost"

model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
reference = copy.deepcopy(model)
with tempfile.TemporaryDirectory() as folder:
    offload_state_dict(folder, {k: v for k, v in model.state_dict().items() if k.startswith("1.")})
    dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, offload_dir=folder, offload_buffers=True)
    assert model[1].running_mean.is_meta
    for m in (model, reference):
        m.train()
        with torch.no_grad():  # BatchNorm updates its running statistics in place
            m(x), m(x + 1)
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x)), "the forward's writes into the offloaded buffers were lost"
print("ok")
