"""merge/unmerge/unload over an offloaded base: PEFT's ``onload_layer`` as one store operation."""

from __future__ import annotations

from typing import Any, Iterator


def onload_layer_replacement(original: Any) -> Any:
    """Upstream's ``onload_layer`` (used by merge/unmerge/unload) for a layer with something
    offloaded, as one :class:`metapatch._offload.operations.Operation`: every offloaded module of the
    layer onloaded, and what the merge writes into the base weight kept for its hook to serve (an
    overlay in CPU memory, as upstream keeps merged weights in the weights map; the offload folder is
    never written). Upstream's own version first builds ``dict(weights_map.dataset)`` (every
    offloaded tensor of the model, read from disk) to look up a file name it never uses, and fails
    with a KeyError when the index lacks that first key, as after a re-dispatch whose weights map
    reads through a state dict. A layer with nothing offloaded gets upstream's, untouched."""
    from contextlib import contextmanager

    @contextmanager
    def onload_layer(layer: Any) -> Iterator[None]:
        from metapatch._offload import operations
        from metapatch._offload.hook_state import offload_hook

        offloaded = [(module, hook) for module in layer.modules()
                     for hook in (offload_hook(module),) if hook is not None]
        if not offloaded:
            with original(layer):
                yield
            return
        with operations.Operation(f"merging or unloading the adapter of {type(layer).__name__}") as operation:
            for module, hook in offloaded:
                operation.onload(module, hook)
            yield

    onload_layer.__doc__ = original.__doc__
    return onload_layer
