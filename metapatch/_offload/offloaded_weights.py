"""Keep an accelerate-offloaded module's weights materialised for the duration of a call, then offload them
again: the shared mechanism of the patches for model code that reads a submodule's weight directly
(``embed_tokens.weight[...]``) instead of calling the submodule.

accelerate keeps an offloaded module's weights on the meta device and loads them only inside that
module's own forward (its ``AlignDevicesHook.pre_forward``). Model code that reads the weight outside
that forward sees the meta placeholder. Running the hook's ``pre_forward`` before the call and its
``post_forward`` after it gives such reads the real weight; ``offload`` is switched off meanwhile so that
the module's own forward, called during the same call, does not put the weight back on meta half-way.
A nested use finds ``offload`` already off and does nothing, so wrappers may nest. A write into a held
tensor is refused when the block ends (``OffloadedWriteError``): putting the weights back on meta would
drop it, so the offloaded model would silently differ from the in-memory one.

Nothing here imports accelerate: a process that never imported ``accelerate.hooks`` has no hooks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from metapatch._offload.hook_state import offload_hooks
from metapatch._framework.records import MetapatchError


class OffloadedWriteError(MetapatchError, RuntimeError):
    """A forward wrote a tensor that metapatch held loaded for it; offloading it again would lose the write."""


# The owner's path and module, the local name, the tensor, its storage pointer and version.
_Signature = Tuple[str, Any, str, Any, int, Optional[int]]


def _signatures(module: Any, hook: Any) -> Dict[str, _Signature]:
    """What ``hook`` will put back on meta, as loaded: its owning module and local name (so that the check
    after the block looks each one up directly instead of walking the module again), the tensor, its
    storage pointer and ``_version``. Inference tensors (loaded under ``torch.inference_mode``) keep no
    version: only a replacement shows there. Quantized tensor classes are left to their library:
    bitsandbytes repacks 4-bit weights on a first forward, and repacks the reloaded ones the same way on
    the next, so nothing is lost there."""
    from metapatch._offload.store import plain_tensor, hook_tensors

    signatures = {}
    for name, tensor in hook_tensors(module, hook):
        if tensor.is_meta or not plain_tensor(tensor):
            continue
        path, _, local = name.rpartition(".")
        signatures[name] = (path, module.get_submodule(path) if path else module, local, tensor, tensor.data_ptr(),
                            None if tensor.is_inference() else tensor._version)
    return signatures


def _current(module: Any, path: str, owner: Any, local: str) -> Any:
    try:
        if path and module.get_submodule(path) is not owner:
            return None  # the owning submodule itself was replaced
    except AttributeError:
        return None  # or removed
    return owner._parameters[local] if local in owner._parameters else owner._buffers.get(local)


def _written(module: Any, before: Dict[str, _Signature]) -> List[str]:
    return [name for name, (path, owner, local, tensor, pointer, version) in before.items()
            if _current(module, path, owner, local) is not tensor or tensor.data_ptr() != pointer
            or (version is not None and tensor._version != version)]


@contextlib.contextmanager
def materialised(*modules: Any) -> Iterator[None]:
    """Within the block, the weights of every offloaded module in ``modules`` are on their execution device.

    A tensor written meanwhile (in place, or replaced) raises :class:`OffloadedWriteError` once the block
    ends: the hook serves its weights map again afterwards, so the write would be lost and the model would
    silently differ from the in-memory one, where it persists. (A write through ``.data`` bumps no
    version and is not seen; checking values would copy every held weight on every forward.)"""
    held: List[Tuple[Any, Any, Dict[str, _Signature]]] = []
    written: List[Tuple[Any, str]] = []
    try:
        for module in modules:
            for hook in offload_hooks(module):
                hook.pre_forward(module)  # load the weights onto the execution device
                hook.offload = False      # so the module's own forward does not offload them mid-way
                held.append((module, hook, _signatures(module, hook)))
        yield
        written = [(module, name) for module, hook, before in held for name in _written(module, before)]
    finally:
        for module, hook, _ in reversed(held):
            hook.offload = True
            hook.post_forward(module, None)  # back to meta, as after the module's own forward
    if written:
        names = ", ".join(f"{type(module).__name__}.{name}" for module, name in written)
        raise OffloadedWriteError(
            f"metapatch: {names} (offloaded by accelerate) was written while metapatch held it loaded for a "
            f"forward that reads it from outside its own module; accelerate serves the offloaded copy again "
            f"afterwards, so the write would be silently lost and the model would differ from the in-memory one. "
            f"Keep that module in memory (device_map), or load the model without offloading.")


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
