"""Training a model with offloaded trainable parameters leaves them untrained, silently.

Layer 1 is offloaded to disk (a meta placeholder between forwards). Each forward loads a copy, the
gradient lands on that copy and is dropped with it, so AdamW's step updates only layer 0; the same
step on the in-memory model updates both. Expected: equal results, or an error before the step.

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


def step(m):
    optimizer = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(x).square().mean().backward()
    optimizer.step()


step(reference)
with tempfile.TemporaryDirectory() as folder:
    offload_state_dict(folder, {k: v for k, v in model.state_dict().items() if k.startswith("1.")})
    dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, offload_dir=folder)
    assert model[1].weight.is_meta and model[1].weight.requires_grad
    try:
        step(model)
    except RuntimeError as error:  # the fix: refused before anything is updated
        assert "offloaded" in str(error), error
        print("refused:", error)
    else:
        with torch.no_grad():
            got, want = model(x), reference(x)
        assert torch.equal(got, want), f"the offloaded layer was not trained: max abs diff {(got - want).abs().max()}"
print("ok")
