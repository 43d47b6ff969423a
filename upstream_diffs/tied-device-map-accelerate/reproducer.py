"""infer_auto_device_map splits a tied group that a Transformers model declares but has not tied yet.

A model built on the meta device declares its ties in `all_tied_weights_keys` (transformers expands
regex `_tied_weights_keys` into it); accelerate finds ties by tensor identity only, so it counts each
copy and may put a copy and its source on different devices (the copy stays on meta after dispatch).
Here the copies come first, as DiffusionGemma's encoder comes before the decoder it is tied to.

Fails with: AssertionError
"""
from collections import OrderedDict

from accelerate import infer_auto_device_map
from torch import nn


def block():
    return nn.Sequential(OrderedDict([("linear1", nn.Linear(3, 4)), ("norm", nn.BatchNorm1d(4)), ("linear2", nn.Linear(4, 5))]))


model = nn.Sequential(OrderedDict([("encoder", block()), ("decoder", block())]))
model.all_tied_weights_keys = {f"encoder.{n}.weight": f"decoder.{n}.weight" for n in ("linear1", "linear2")}
tensors = [*model.named_parameters(), *model.named_buffers()]
sizes = {name: t.numel() * t.element_size() for name, t in tensors}
del sizes["encoder.linear1.weight"], sizes["encoder.linear2.weight"]  # one tensor each with its source, once tied

for budget in (1000, 400, 300, 200, 120, 60):
    device_map = infer_auto_device_map(model, max_memory={0: budget, "cpu": budget})

    def device_of(name):
        return device_map[max((k for k in device_map if k in ("", name) or name.startswith(k + ".")), key=len)]

    for n in ("linear1", "linear2"):
        copy, source = device_of(f"encoder.{n}.weight"), device_of(f"decoder.{n}.weight")
        assert copy == source, f"budget {budget}: encoder.{n}.weight on {copy}, its source on {source}: {device_map}"
    for device in (0, "cpu"):
        used = sum(size for name, size in sizes.items() if device_of(name) == device)
        assert used <= budget, f"budget {budget}: {used} bytes on {device}: {device_map}"
print("ok: every tied group on one device, every budget kept")
