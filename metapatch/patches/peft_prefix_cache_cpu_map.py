"""peft-prefix-cache-cpu-map: prefix tuning over a model whose device map names no accelerator
(``device_map="cpu"``, CPU and disk offload on a machine without a GPU) places its virtual-token cache on
the CPU instead of failing at the first forward.

A prefix-tuning ``PeftModel`` builds a ``Cache`` of virtual tokens at each forward (``get_prompt``) and, for a
base with an ``hf_device_map``, moves each layer's keys and values to that layer's device
(``map_cache_to_layer_device_map``). ``get_layer_device_map`` takes the map's first entry that is neither
``"cpu"`` nor ``"disk"`` as the device offloaded layers compute on. A map without one (``{"": "cpu"}``, or
``{"...layers.0": "cpu", "...layers.1": "disk", ...}``) has none: ``StopIteration`` (peft 0.21;
``IndexError`` from ``[...][0]`` in earlier releases), on every forward and ``generate``. Such a map
computes everything on the CPU: accelerate's ``dispatch_model`` picks ``"cpu"`` as the main device when
the map holds nothing else, and that is where the cache must be. Here a map without an accelerator entry
maps every layer to ``"cpu"``; any other map calls upstream untouched (a GPU machine's maps name their GPU
and never reach the bug). The prompt-learning methods that build no cache (prompt tuning, P-tuning) do not
call the function.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream

PATCH_ID = "peft-prefix-cache-cpu-map"
STORAGE = ("cpu", "disk")  # map values that say where a module is stored; without an accelerator both compute on cpu


def _get_layer_device_map(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> Any:
    model = signature_of(wrapped).bind_partial(*args, **kwargs).arguments.get("model")
    device_map = getattr(model, "hf_device_map", None)
    # upstream's own test: a torch.device("cpu") value (transformers 4.57's device_map="cpu") is not "cpu"
    # there, and upstream handles that map
    if not device_map or any(device not in STORAGE for device in device_map.values()):
        return wrapped(*args, **kwargs)
    return {index: "cpu" for index in range(model.config.num_hidden_layers)}


PATCH = Patch(
    id=PATCH_ID,
    title='prefix tuning over a model whose device map names no accelerator (device_map="cpu", CPU and disk '
          'offload) keeps its virtual-token cache on the CPU instead of failing with StopIteration/IndexError',
    # The code (docs/survey/peft-prefix-cache-cpu-map.md): 0.17.0-0.19.1 take [...][0] (IndexError), 0.20.0
    # next(...) (StopIteration), 0.21 the same with type annotations. Open upstream (huggingface/peft#3619,
    # a fix proposed in #3621).
    affects={"peft": ">=0.17"},
    targets=(
        Target("peft.utils.integrations", "get_layer_device_map",
               fingerprints=("7149b6c7260d2ab2", "8a1a214ba040bbc0", "7924d8449b9e70bf"),
               wrapper=_get_layer_device_map),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/peft/issues/3619", "https://github.com/huggingface/peft/pull/3621"),
        forwarded="no",
        note="peft: get_layer_device_map falls back to the CPU when the device map names no accelerator",
    ),
)
