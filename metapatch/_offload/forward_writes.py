"""A write a forward makes into its own offloaded tensors reaches the next forward, or raises.

accelerate loads an offloaded module's tensors before its forward (``pre_forward``) and puts ``meta``
placeholders back after it (``post_forward``), dropping what it loaded. A forward that writes into its own
tensors loses the write: BatchNorm in training mode updates ``running_mean``, ``running_var`` and
``num_batches_tracked`` in place (offloaded with ``offload_buffers=True``), ``spectral_norm`` its ``u`` and
``v`` vectors. In memory they persist: the next forward, ``eval()`` and ``state_dict()`` read them. Upstream the
next load serves the stored values again, silently (with ``cpu_offload`` on a CPU execution device the loaded
tensor is the stored one, so the write happens to survive; on disk, or onto an accelerator, it is lost).

:func:`note_versions` runs after every load: each plain tensor the hook loaded carries its ``_version``.
:func:`keep_forward_writes` runs before the hook puts the placeholders back: a tensor whose ``_version`` moved was
written, and is kept by the store's rule (:func:`metapatch._offload.store.keep`: a CPU copy the hook serves from
then on; the user's offload folder is never written); a write into a tied weight raises. BatchNorm's kernel
updates its running statistics without moving their ``_version``, and an inference tensor (loaded under
``torch.inference_mode``) has none: for a module in training mode the buffers' values are copied at the load and
compared instead (the statistics BatchNorm and ``spectral_norm`` update there are small). Not seen: a write a
forward makes through ``.data`` (it moves no ``_version``) or into a parameter under ``inference_mode``.
Quantized classes (``Params4bit``) are their library's: bitsandbytes repacks 4-bit weights on a first forward.
Callers that onload a module for an operation of their own, and apply the store's rule themselves, settle it
before offloading it again (:func:`metapatch._offload.store.settle`).

Nothing here imports torch or accelerate at import time.
"""

from __future__ import annotations

from typing import Any

from metapatch._offload.offloaded_weights import OffloadedWriteError
from metapatch._offload.store import LOADED_VERSION, keep, refuse, slot_tensors, tied_name, torch_plain

def note_versions(module: Any, hook: Any) -> None:
    """After ``hook`` loaded ``module``'s tensors: remember where each one's ``_version`` stands, or, for a buffer of a
    module in training mode, its values (BatchNorm's kernel updates its running statistics without moving their
    ``_version``, measured on torch 2.13; an inference tensor has none)."""
    buffers = None
    for name, tensor in slot_tensors(module, hook):
        if tensor.is_meta or not torch_plain(tensor):
            continue
        if module.training:
            if buffers is None:
                buffers = {id(b) for b in module.buffers(recurse=hook.place_submodules)}
            if id(tensor) in buffers:
                tensor.__dict__[LOADED_VERSION] = (tensor.clone(),)
                continue
        if not tensor.is_inference():
            tensor.__dict__[LOADED_VERSION] = tensor._version


def _written(tensor: Any) -> bool:
    loaded = tensor.__dict__.get(LOADED_VERSION)
    if loaded is None:
        return False
    if isinstance(loaded, tuple):
        import torch

        return not torch.equal(tensor, loaded[0])
    return tensor.is_inference() or tensor._version != loaded


def keep_forward_writes(module: Any, hook: Any) -> None:
    """Before ``hook`` offloads ``module`` again after its forward: every loaded tensor the forward wrote is kept for
    the hook to serve; a write into a tied weight raises :class:`OffloadedWriteError` (accelerate serves each tied
    copy from its own hook, so keeping one would leave the other with the old value)."""
    tied = []
    for name, tensor in slot_tensors(module, hook):
        if tensor.is_meta or LOADED_VERSION not in tensor.__dict__ or not _written(tensor):
            continue
        del tensor.__dict__[LOADED_VERSION]
        if tied_name(module, hook, name):
            tied.append((module, name))
            continue
        import torch

        with torch.inference_mode(False):  # a normal copy: accelerate makes a parameter of it at the next load
            keep(hook, name, tensor)
    refuse("a forward", [], tied, OffloadedWriteError)

