"""Keep an accelerate-offloaded module's weights materialised for the duration of a call, then offload them
again: the shared mechanism of the patches for model code that reads a submodule's weight directly
(``embed_tokens.weight[...]``) instead of calling the submodule.

accelerate keeps an offloaded module's weights on the meta device and loads them only inside that
module's own forward (its ``AlignDevicesHook.pre_forward``). Model code that reads the weight outside
that forward sees the meta placeholder. Running the hook's ``pre_forward`` before the call and its
``post_forward`` after it gives such reads the real weight; ``offload`` is switched off meanwhile so that
the module's own forward, called during the same call, does not put the weight back on meta half-way.
A nested use finds ``offload`` already off and does nothing, so wrappers may nest.

Nothing here imports accelerate: a process that never imported ``accelerate.hooks`` has no hooks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Tuple

from metapatch._hook_state import offload_hooks  # noqa: F401 - re-exported: patches import it from here


@contextlib.contextmanager
def materialised(*modules: Any) -> Iterator[None]:
    """Within the block, the weights of every offloaded module in ``modules`` are on their execution device."""
    held: List[Tuple[Any, Any]] = []
    try:
        for module in modules:
            for hook in offload_hooks(module):
                hook.pre_forward(module)  # load the weights onto the execution device
                hook.offload = False      # so the module's own forward does not offload them mid-way
                held.append((module, hook))
        yield
    finally:
        for module, hook in reversed(held):
            hook.offload = True
            hook.post_forward(module, None)  # back to meta, as after the module's own forward


def _attribute(instance: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        instance = getattr(instance, name, None)
        if instance is None:
            return None
    return instance


def call_with_materialised(*attributes: str) -> Callable[..., Any]:
    """A wrapt wrapper for a method that reads the weights of ``instance.<attribute>`` directly: the call
    runs with those modules materialised (see :func:`materialised`)."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        modules = [_attribute(instance, dotted) for dotted in attributes]
        if not any(offload_hooks(module) for module in modules):
            return wrapped(*args, **kwargs)  # nothing offloaded (or already materialised): no cost
        with materialised(*modules):
            return wrapped(*args, **kwargs)

    return wrapper
