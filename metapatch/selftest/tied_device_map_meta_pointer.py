"""Reproducer for tied-device-map-meta-pointer: accelerate's load_checkpoint_and_dispatch of a meta
module with two tied groups on disk (a plain torch module: no transformers needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Scenario
from ._tied import LOGITS_TOLERANCE

PATCH_ID = "tied-device-map-meta-pointer"

def _two_tied_groups_module() -> Any:
    import torch.nn as nn

    class TwoTiedPairs(nn.Module):
        """Two tied pairs of different shapes, the way DiffusionGemma ties several tensors at once."""

        def __init__(self) -> None:
            super().__init__()
            self.embed_a = nn.Embedding(16, 8)
            self.embed_b = nn.Embedding(16, 12)
            self.mix = nn.Linear(20, 20)
            self.head_a = nn.Linear(8, 16, bias=False)
            self.head_b = nn.Linear(12, 16, bias=False)
            self.head_a.weight = self.embed_a.weight
            self.head_b.weight = self.embed_b.weight

        def forward(self, ids: Any) -> Any:
            import torch

            hidden = self.mix(torch.cat([self.embed_a(ids), self.embed_b(ids)], dim=-1))
            return self.head_a(hidden[..., :8]) + self.head_b(hidden[..., 8:])

    return TwoTiedPairs


def meta_pointer_two_tied_groups(workdir: Path) -> Dict[str, Any]:
    """accelerate's load_checkpoint_and_dispatch of a meta model with two tied groups on disk: before
    1.15 every meta tensor reports data_ptr() 0, the groups share one cache slot and one tied module
    receives the other's weight (a shape error, or a wrong result)."""
    import torch
    from accelerate import dispatch_model, init_empty_weights, load_checkpoint_in_model
    from safetensors.torch import save_file

    from ._device import main_device, to_device
    from ._models import max_abs_diff

    module_class = _two_tied_groups_module()
    torch.manual_seed(0)
    reference = module_class().eval()
    # Every name stored (tied copies as their own tensors), as a checkpoint written by torch.save would be:
    # the scenario is about the hooks' cache of tied weights, not about missing checkpoint entries.
    state = {name: tensor.detach().clone().contiguous() for name, tensor in reference.state_dict().items()}
    save_file(state, str(workdir / "model.safetensors"), metadata={"format": "pt"})
    with init_empty_weights():
        model = module_class()
    device_map = {"embed_a": "disk", "embed_b": "disk", "mix": main_device(), "head_a": "disk", "head_b": "disk"}
    offload = workdir / "offload"
    load_checkpoint_in_model(model, str(workdir / "model.safetensors"), device_map=device_map,
                             offload_folder=str(offload))
    # Loading replaces each parameter on its own; tie again, as transformers does before dispatching.
    model.head_a.weight = model.embed_a.weight
    model.head_b.weight = model.embed_b.weight
    model = dispatch_model(model, device_map=device_map, offload_dir=str(offload)).eval()
    ids = to_device(torch.tensor([[1, 2, 3, 4, 5]]))
    with torch.no_grad():
        got, want = model(ids), to_device(reference)(ids)
    diff = max_abs_diff(got, want)
    if diff > LOGITS_TOLERANCE:
        raise AssertionError(f"outputs differ from the in-memory module (max abs diff {diff})")
    return {"max_abs_diff": diff}



SCENARIOS = [
    Scenario(PATCH_ID, "two-tied-groups-on-disk", f"{__name__}:meta_pointer_two_tied_groups",
             "load_checkpoint_and_dispatch of a meta module with two tied pairs on disk: before accelerate "
             "1.15 both share the meta pointer 0 and one gets the other's weight", expected_error="RuntimeError",
             tolerance=LOGITS_TOLERANCE),
]
