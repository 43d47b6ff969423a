"""One spelling for a device-map value, so that two places compare devices, not spellings.

accelerate and transformers accept ``0``, ``"cuda:0"`` and ``torch.device("cuda", 0)`` for the same GPU in a
device map (an int is an accelerator index), and ``"cpu"`` or ``torch.device("cpu")`` for the CPU; a user's map
may mix them. Import-cheap: no torch.
"""

from __future__ import annotations

from typing import Any


def norm_device(value: Any) -> str:
    """``value`` as a string: an int index as ``"cuda:<i>"``, a ``torch.device`` as its ``str``, "disk" as it is."""
    text = str(value)
    return f"cuda:{text}" if text.isdigit() else text
