"""4-bit layers offloaded by accelerate lose their quantization state to the meta device.

accelerate offloads a weight by moving it to meta and reloads it before each forward as
`Params4bit(offloaded_data, **meta_param.__dict__).to(device)`: the reload uses the meta
parameter's QuantState, whose absmax and code `QuantState.to("meta")` moved to meta in place.
(With double quant, dispatch already fails earlier: `offset.item()` on meta in `as_dict`.)

Fails with: NotImplementedError
"""
import tempfile

import bitsandbytes as bnb
import torch
from accelerate import dispatch_model
from torch import nn

torch.manual_seed(0)
layers = [bnb.nn.Linear4bit(64, 64, compress_statistics=False, quant_type="nf4") for _ in range(2)]
model = nn.Sequential(*layers).to("cpu")  # quantizes the weights (on the CPU)
x = torch.randn(2, 64)
with torch.no_grad():
    expected = model(x)
    with tempfile.TemporaryDirectory() as offload_dir:
        dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=offload_dir)
        for _ in range(2):  # the second forward reloads from the state the first one offloaded
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # Cannot copy out of meta tensor
print("ok: the offloaded 4-bit layer computes what the in-memory one does")
