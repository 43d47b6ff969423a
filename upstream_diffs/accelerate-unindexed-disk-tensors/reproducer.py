"""dispatch_model with an offload_index that lacks a disk-mapped tensor drops the tensor's value.

An index built from a checkpoint has no entry for a tensor no checkpoint holds (MarianMT's sinusoidal
table, computed at load): the hook puts it on meta and looks it up in the index at the first forward.

Fails with: KeyError
Affected: diff
"""
import os
import tempfile

import torch
from accelerate import dispatch_model
from accelerate.utils import offload_weight
from torch import nn

model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
x = torch.randn(2, 3)
expected = model(x)
with tempfile.TemporaryDirectory() as offload_dir:
    # The checkpoint held only the weight of the second layer: the bias is the model's own.
    index = offload_weight(model[1].weight.detach(), "1.weight", offload_dir, {})
    dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=offload_dir, offload_index=index)
    torch.testing.assert_close(model(x), expected)  # KeyError: '1.bias' without the fix
    assert os.listdir(offload_dir) == ["1.weight.dat"]
print("ok: the tensor missing from the index was served")
