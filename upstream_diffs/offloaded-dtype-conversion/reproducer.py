"""model.to(dtype) on a dispatched model with offloaded parts is refused although nothing moves.

Half of the layers are offloaded to disk; `model.to(torch.float16)` names no device, but accelerate's
guard on `model.to` raises because some parameters are on meta. `model.half()` (not guarded) shows the
conversion itself works: the hooks cast the offloaded weights as they load them.

Fails with: RuntimeError
Affected: diff
"""
import copy
import tempfile

import torch
from accelerate import dispatch_model
from accelerate.utils import offload_state_dict
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
reference = copy.deepcopy(model).to(torch.bfloat16)
x = torch.randn(2, 8)
with tempfile.TemporaryDirectory() as folder:
    offload_state_dict(folder, {k: v for k, v in model.state_dict().items() if k.startswith("2.")})
    dispatch_model(model, device_map={"0": "cpu", "1": "cpu", "2": "disk"}, offload_dir=folder)
    assert model[2].weight.is_meta
    assert model.to(torch.bfloat16) is model
    with torch.no_grad():
        got, expected = model(x.to(torch.bfloat16)), reference(x.to(torch.bfloat16))
    assert torch.equal(got, expected), (got - expected).abs().max()
    assert model[2].weight.is_meta  # still offloaded
print("ok")
