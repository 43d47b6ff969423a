"""Reproducers for offloaded-model-device-v4: transformers 4.57 has the ``model.device`` bug of
offloaded-model-device in another source of the property; the same scenarios, for transformers < 5."""

from __future__ import annotations

from .offloaded_model_device import scenarios

PATCH_ID = "offloaded-model-device-v4"

SCENARIOS = scenarios(PATCH_ID, {"transformers": "<5.0.0.dev0"}, "transformers 4.57: ")
