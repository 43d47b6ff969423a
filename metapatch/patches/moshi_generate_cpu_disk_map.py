"""moshi-generate-cpu-disk-map: Moshi's ``generate`` over a device map that names no accelerator (layers on cpu and
disk, as ``device_map="auto"`` with a ``max_memory`` or an explicit map places them on a machine without a GPU)
computes on the CPU instead of failing with ``IndexError: list index out of range``.

``MoshiForConditionalGeneration.generate`` splits the model's ``hf_device_map`` on its first call: the depth
decoder gets a map of its own, used to place each layer's cache, in which every offloaded entry (``"cpu"`` or
``"disk"``) is replaced by the model's "main device", ``[d for d in hf_device_map.values() if d not in ["cpu",
"disk"]][0]``: the first accelerator in the map. A map without one has none, and every ``generate`` fails there,
while the in-memory model and the same model with a GPU in its map generate. Such a map computes everything on the
CPU (accelerate's ``dispatch_model`` picks ``"cpu"`` as the main device when the map holds nothing else), so that
is the main device: here the split is made as upstream makes it, with ``"cpu"``, before upstream's ``generate``
runs (which then finds it made and keeps it). Every other map (one naming a GPU, ``{"": ...}``, a model without
a map, a second call) goes to upstream untouched.

The same mechanism, "the map's first device other than cpu/disk", was fixed in transformers' static cache
(huggingface/transformers#34647) and is patched in peft's prefix tuning (``peft-prefix-cache-cpu-map``, peft#3619);
in transformers 4.57.1 - 5.25.0, accelerate 1.10 - 1.16 and peft 0.17 - 0.21 the other readers of that value
(``Trainer``, ``infer_auto_device_map``, ``dispatch_model``, the hub kernels) handle a map without one. Moshi's
``generate`` has the line in every release of the support window.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from metapatch._framework.records import Patch, Target, Upstream

PATCH_ID = "moshi-generate-cpu-disk-map"
STORAGE = ("cpu", "disk")  # map values that say where a module is stored; without an accelerator both compute on cpu
DEPTH = "depth_decoder"


def _generate(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    device_map = getattr(instance, "hf_device_map", None)
    depth_decoder = getattr(instance, DEPTH, None)
    if not device_map or "" in device_map or depth_decoder is None or hasattr(depth_decoder, "hf_device_map") \
            or any(device not in STORAGE for device in device_map.values()):
        return wrapped(*args, **kwargs)
    # upstream's own split (the depth decoder's keys keep their leading "."), with the CPU as the main device
    depth_decoder.hf_device_map = {key[len(DEPTH):]: "cpu" for key in device_map if key.startswith(DEPTH)}
    instance.hf_device_map = {key: device for key, device in device_map.items() if not key.startswith(DEPTH)}
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id=PATCH_ID,
    title="Moshi's generate over a device map that names no accelerator (cpu and disk offload on a machine without "
          "a GPU) computes on the CPU instead of failing with IndexError",
    # Every release of the window has the line (docs/survey/moshi-generate-cpu-disk-map.md); no upstream fix yet.
    affects={"transformers": ">=4.57.1"},
    targets=(
        Target("transformers.models.moshi.modeling_moshi", "MoshiForConditionalGeneration.generate",
               fingerprints=("6270f69b65120398",   # transformers 4.57.1 - 4.57.6
                             "de11e6f41f66ada2",   # transformers 5.0.0 - 5.22.2
                             "073e72464fe51830"),  # transformers 5.23.0 - 5.25.0
               wrapper=_generate),
    ),
    upstream=Upstream(
        bug=(),
        forwarded="no",
        note="transformers: MoshiForConditionalGeneration.generate falls back to the CPU as the main device when the "
             "device map names no accelerator",
    ),
)
