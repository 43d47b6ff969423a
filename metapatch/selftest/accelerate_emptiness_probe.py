"""accelerate-emptiness-probe: dispatch must not serialize modules to learn whether they are empty.

A layer whose ``_save_to_state_dict`` computes something from its weight (quantized layers store their
quantization state this way: bitsandbytes' ``Linear4bit``, where bnb-quant-state-offload's scenarios show it)
cannot be serialized once its weight is offloaded to meta; accelerate's ``attach_execution_device_hook``
called ``state_dict()`` on every module while dispatching, only to test whether it holds tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from metapatch.selftest._harness import Scenario


def _layers() -> Any:
    import torch
    from torch import nn

    class ScaledLinear(nn.Linear):
        """Saves its largest weight magnitude beside its weight, as quantized layers save a scale."""

        def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            destination[prefix + "absmax"] = torch.tensor(self.weight.detach().abs().max().item())

    return ScaledLinear


def dispatch_layer_that_serializes_its_weight(workdir: Path) -> Dict[str, Any]:
    """A block of such layers offloaded to disk with ``dispatch_model``; the forward equals the in-memory model."""
    import copy

    import torch
    from accelerate import dispatch_model
    from torch import nn

    scaled = _layers()
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(8, 16))
    # Nested as in a transformer layer (layer -> attention -> projections): accelerate hooks the offloaded block
    # and the layers holding weights; the probe serializes the containers between them.
    model.add_module("block", nn.Sequential(nn.Sequential(scaled(16, 16), nn.ReLU()), nn.Sequential(scaled(16, 8))))
    model.eval()
    reference = copy.deepcopy(model)
    inputs = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(inputs)
    dispatched = dispatch_model(model, {"embed": "cpu", "block": "disk"}, main_device="cpu",
                                offload_dir=str(workdir / "offload"))
    with torch.no_grad():
        got = dispatched(inputs)
    diff = float((got - want).abs().max())
    if not torch.equal(got, want):
        raise AssertionError(f"the dispatched model differs from the in-memory one: {diff}")
    return {"max_abs_diff": diff}


SCENARIOS = [
    Scenario("accelerate-emptiness-probe", "dispatch-layer-that-serializes-its-weight",
             f"{__name__}:dispatch_layer_that_serializes_its_weight",
             "a layer whose state_dict() reads its weight, offloaded to disk by dispatch_model",
             expected_error="RuntimeError", expected_message=r"Tensor\.item\(\) cannot be called on meta tensors",
             quick=True),
]
