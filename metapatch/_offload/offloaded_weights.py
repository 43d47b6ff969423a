"""Keep an accelerate-offloaded module's weights materialised for the duration of a call, then offload them
again: the shared mechanism of the patches for model code that reads a submodule's weight directly
(``embed_tokens.weight[...]``) instead of calling the submodule.

accelerate keeps an offloaded module's weights on the meta device and loads them only inside that
module's own forward (its ``AlignDevicesHook.pre_forward``). Model code that reads the weight outside
that forward sees the meta placeholder. Running the hook's ``pre_forward`` before the call and its
``post_forward`` after it gives such reads the real weight; ``offload`` is switched off meanwhile so that
the module's own forward, called during the same call, does not put the weight back on meta half-way.
A nested use finds ``offload`` already off and does nothing, so wrappers may nest. A write into a held
tensor (in place, through ``.data``, under ``torch.inference_mode``, or a replacement) is kept by the
offload store when the block ends, as the in-memory model keeps it: putting the weights back on meta
would drop it. One the store cannot keep (a tied weight) raises ``OffloadedWriteError``.

Nothing here imports accelerate: a process that never imported ``accelerate.hooks`` has no hooks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Tuple

from metapatch._offload.hook_state import offload_hooks
from metapatch._framework.records import MetapatchError


class OffloadedWriteError(MetapatchError, RuntimeError):
    """A forward wrote a tensor that metapatch held loaded for it; offloading it again would lose the write."""


@contextlib.contextmanager
def materialised(*modules: Any, watch_values: bool = True) -> Iterator[None]:
    """Within the block, the weights of every offloaded module in ``modules`` are on their execution device.

    A tensor written meanwhile (in place, through ``.data``, under ``torch.inference_mode``, or replaced)
    is kept by the offload store (:func:`metapatch._offload.store.keep_changes`: a CPU copy the hook serves
    from then on), as the in-memory model keeps it; with ``watch_values`` each held tensor's values are
    copied when it is loaded, since ``.data`` and inference-mode writes bump no version (the price: the tensor
    is held twice while the block runs). Without it, a replacement or an in-place write that bumps the version
    is still kept: for calls whose code is known to only read the weights. A write the store cannot keep (a
    weight tied to another hook's) raises :class:`OffloadedWriteError` once the block ends. Quantized
    tensor classes are left to their library: bitsandbytes repacks 4-bit weights on a first forward, and
    repacks the reloaded ones the same way on the next, so nothing is lost there."""
    from metapatch._offload.store import keep_changes, refuse, settle, snapshot

    held: List[Tuple[Any, Any, Dict[str, Any]]] = []
    refused: List[Tuple[Any, str, Any]] = []
    tied: List[Tuple[Any, str]] = []
    try:
        for module in modules:
            for hook in offload_hooks(module):
                hook.pre_forward(module)  # load the weights onto the execution device
                hook.offload = False      # so the module's own forward does not offload them mid-way
                held.append((module, hook, snapshot(module, hook, values=watch_values, plain_only=True)))
        yield
        for module, hook, taken in held:
            keep_changes(module, hook, taken, refused, tied, plain_only=True)
    finally:
        for module, hook, _ in reversed(held):
            settle(module, hook)  # the rule is applied (or the block raised): the offload keeps nothing more
            hook.offload = True
            hook.post_forward(module, None)  # back to meta, as after the module's own forward
    refuse("a forward reading it from outside its own module (held loaded by metapatch)", refused, tied,
           OffloadedWriteError)


def _attribute(instance: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        instance = getattr(instance, name, None)
        if instance is None:
            return None
    return instance


def call_with_materialised(*attributes: str) -> Callable[..., Any]:
    """A wrapt wrapper for a method that reads the weights of ``instance.<attribute>`` directly: the call
    runs with those modules materialised (see :func:`materialised`). The methods a patch names this way are
    upstream model code that reads the weight (an embedding lookup): no copy of its values is taken, which for
    Gemma 4's large offloaded embeddings would double the memory the call holds; replacements and in-place
    writes that bump the version are still kept."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        modules = [_attribute(instance, dotted) for dotted in attributes]
        if not any(offload_hooks(module) for module in modules):
            return wrapped(*args, **kwargs)  # nothing offloaded (or already materialised): no cost
        with materialised(*modules, watch_values=False):
            return wrapped(*args, **kwargs)

    return wrapper
