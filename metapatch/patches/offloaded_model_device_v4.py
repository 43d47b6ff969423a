"""offloaded-model-device on transformers 4.57: the same fix for the same bug, where ``ModuleUtilsMixin.device``
has another source (``get_parameter_device(self)``) that the upstream diff, written for 5.x, does not
match. The behaviour and the reasoning are those of :mod:`metapatch.patches.offloaded_model_device`.
"""

from __future__ import annotations

from .._framework.records import Patch, Target, Upstream
from .offloaded_model_device import _device_property

PATCH_ID = "offloaded-model-device-v4"

PATCH = Patch(
    id=PATCH_ID,
    title="transformers 4.57: model.device of a model whose first parameter is offloaded is the offload hook's "
          "execution device, not meta",
    # Measured (selftest generate-embedding-on-disk, unpatched: RuntimeError "Tensor.item() cannot be
    # called on meta tensors") on 4.57.6.
    affects={"transformers": ">=4.57.0,<5.0.0.dev0"},
    targets=(
        Target("transformers.modeling_utils", "ModuleUtilsMixin.device",
               fingerprints=("62d5f6c339dcc96d",),  # 4.57.x: return get_parameter_device(self)
               replacement=_device_property),
    ),
    upstream=Upstream(
        bug=("https://github.com/QwenLM/Qwen2.5-Omni/issues/110",),
        forwarded="not-needed",
        note="transformers 4.57 is a maintenance line; the fix for current releases is "
             "upstream_diffs/offloaded-model-device/transformers.diff.",
    ),
    diagnoses=("model-device-meta",),  # metapatch.diagnose findings this fixes
)
