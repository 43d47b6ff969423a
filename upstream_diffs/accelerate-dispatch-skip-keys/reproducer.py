"""dispatch_model without skip_keys gives each hooked layer a copy of a dict the layers share.

Transformers models list such inputs in `_skip_keys_device_placement` (Gemma 4: `shared_kv_states`);
`from_pretrained` passes them to dispatch_model, direct callers (PEFT's `load_adapter`) do not, and
the consumer layer never sees what the producer wrote.

Fails with: KeyError
Affected: diff
"""
import tempfile

import torch
from accelerate import dispatch_model
from torch import nn


class Producer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x, shared):
        shared["state"] = self.linear(x)
        return x


class Consumer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x, shared):
        return self.linear(x) + shared["state"]


class SharedStateModel(nn.Module):
    _skip_keys_device_placement = ["shared"]

    def __init__(self):
        super().__init__()
        self.producer, self.consumer = Producer(), Consumer()

    def forward(self, x):
        shared = {}
        return self.consumer(self.producer(x, shared=shared), shared=shared)


model = SharedStateModel()
x = torch.randn(2, 3)
expected = model(x)
with tempfile.TemporaryDirectory() as offload_dir:
    dispatch_model(model, {"producer": "cpu", "consumer": "disk"}, offload_dir=offload_dir)
    torch.testing.assert_close(model(x), expected)  # KeyError: 'state' without the fix
print("ok: the layers shared one dict")
