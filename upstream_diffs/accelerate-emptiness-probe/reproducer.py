"""attach_execution_device_hook calls state_dict() on every module just to see whether it is empty.

That runs each module's `_save_to_state_dict`, which for quantized layers whose quantization state
is offloaded to the meta device (bitsandbytes 4-bit) fails while dispatching.

Fails with: RuntimeError
"""
import torch
from accelerate.hooks import AlignDevicesHook, attach_execution_device_hook
from torch import nn


class RefusesToSerialize(nn.Linear):
    # stands in for a quantized layer whose state_dict cannot be built while it is offloaded
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise RuntimeError("state_dict() was called to attach a hook")


model = nn.Sequential(RefusesToSerialize(3, 4), nn.ReLU())
attach_execution_device_hook(model, "cpu")  # RuntimeError without the fix
assert isinstance(model[0]._hf_hook, AlignDevicesHook)
print(model(torch.randn(2, 3)).shape, "ok")
