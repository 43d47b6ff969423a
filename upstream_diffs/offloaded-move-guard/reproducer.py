"""Moving a submodule (or calling nn.Module.to) of a model with offloaded modules fails deep in torch.

dispatch_model guards only the top-level `model.to`; `model[1].to("cpu")`, `model.cpu()` via
`nn.Module.to(model, ...)` or a PeftModel's `.to()` reach torch's meta-tensor copy instead of a clear
error, and a move of the whole tree may convert earlier modules before it fails.

Fails with: NotImplementedError
"""
import tempfile

import torch
from accelerate import dispatch_model
from torch import nn

model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
x = torch.randn(2, 3)
expected = model(x)
with tempfile.TemporaryDirectory() as offload_dir:
    dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=offload_dir)
    try:
        nn.Module.to(model, "cpu", torch.float64)
    except NotImplementedError:
        raise  # without the fix: Cannot copy out of meta tensor; no data!
    except RuntimeError as error:  # the fix: a clear error, before anything is converted
        print("refused:", error)
    assert model[0].weight.dtype == torch.float32, "the refused move converted part of the model"
    torch.testing.assert_close(model(x), expected)
print("ok: a clear error, and the model is unchanged")
