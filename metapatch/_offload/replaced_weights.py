"""A tensor the program puts in place of an offloaded weight's placeholder is what the next forward reads, or is
refused.

``module.weight = nn.Parameter(value)``, ``register_parameter`` and ``load_state_dict(..., assign=True)`` replace
the meta placeholder an offload hook keeps between forwards. In memory the module computes with the new tensor
from then on; upstream the hook's next load puts the stored value over it, silently (and a tensor the hook never
stored, a bias registered after dispatch, fails that load with ``KeyError``). :func:`adopt_replacements` runs
before every load of an offloaded module's weights (its forward, and every reader that loads them through the
hook) and keeps such a tensor for the hook to serve, in the store's :class:`~metapatch._offload.store.Overlay`:
the tensor itself, so a later write into it shows, as in memory. A replaced tied weight is untied, as in memory
(its partner keeps its own tensor); a re-tie that puts the partner's tensor in the slot (``tie_weights()`` after
dispatch, the partner in memory) keeps that very tensor, so both read one storage. A replacement of a tensor class
the store cannot keep (a quantized one) raises :class:`~metapatch._offload.offloaded_weights.OffloadedWriteError`. :func:`note_loaded` tags what the hook loads
itself, so that a forward that raised before its ``post_forward`` leaves nothing that would be taken for a
replacement. A trainable replacement never gets a gradient (each forward loads a copy of it):
:func:`adopted_trainable` names them for ``offloaded-training-refusal``.

Nothing here imports torch or accelerate at import time.
"""

from __future__ import annotations

from typing import Any, List, Optional

from metapatch._offload.hook_state import weights_map_of
from metapatch._offload.placeholder_writes import untie
from metapatch._offload.write_replay import describe, write_error
from metapatch._offload.holds import held
from metapatch._offload.store import HOOK_LOADED, overlay_of, plain_tensor, slot_tensors, torch_plain


_LOADED_OTHERS: List[Any] = []  # [WeakIdKeyDictionary: a loaded tensor of a quantized class -> True], built on first use


def note_loaded(module: Any, hook: Any) -> None:
    """After ``hook`` loaded ``module``'s weights: tag them as the hook's (see :func:`adopt_replacements`). A plain
    tensor carries the tag in its ``__dict__``; a quantized class (``Params4bit``) is remembered by identity instead:
    accelerate rebuilds one with its ``__dict__`` as keyword arguments, which bitsandbytes < 0.50 refuses."""
    for _, tensor in slot_tensors(module, hook):
        if tensor.is_meta:
            continue
        if torch_plain(tensor) or plain_tensor(tensor):
            tensor.__dict__[HOOK_LOADED] = True
        else:
            if not _LOADED_OTHERS:
                from torch.utils.weak import WeakIdKeyDictionary

                _LOADED_OTHERS.append(WeakIdKeyDictionary())
            _LOADED_OTHERS[0][tensor] = True


def _hook_loaded(tensor: Any) -> bool:
    return HOOK_LOADED in tensor.__dict__ or bool(_LOADED_OTHERS and tensor in _LOADED_OTHERS[0])


_ADOPTED: List[Any] = []  # [WeakIdKeyDictionary: the program's trainable tensor -> "Module.name"], built on first use


def adopted_trainable() -> Optional[Any]:
    """The trainable tensors :func:`adopt_replacements` took from the program (each mapped to "Module.name"), or None
    before the first: every forward loads a copy of such a tensor, so a gradient never reaches the program's object
    (``offloaded-training-refusal`` refuses an optimizer step over one, as over a placeholder)."""
    return _ADOPTED[0] if _ADOPTED else None


def adopt_replacements(module: Any, hook: Any) -> None:
    """Before ``hook`` loads ``module``'s weights: a real tensor in a slot the hook fills, which no hook loaded,
    was put there by the program (``module.weight = nn.Parameter(value)``, ``register_parameter``,
    ``load_state_dict(..., assign=True)``): the hook serves it from now on, as the in-memory module computes with
    it. Kept as it is (on its device, its storage shared), so a later write into the program's tensor reaches the
    next forward too; an inference tensor is copied (accelerate cannot make a parameter of one)."""
    if held(hook):
        return
    replaced = [(name, tensor) for name, tensor in slot_tensors(module, hook)
                if not tensor.is_meta and not _hook_loaded(tensor)]
    if not replaced or weights_map_of(hook) is None:
        return
    # A tied weight is no exception: replacing it unties it in memory too (the partner keeps its tensor), and a
    # re-tie that puts the partner's own tensor here (tie_weights() after dispatch, with the partner in memory) is
    # kept as that very tensor, so the two still read one storage.
    for name, tensor in replaced:
        if not plain_tensor(tensor):
            raise write_error(f"metapatch: {describe(module, name)} of an offloaded module was replaced by a "
                         f"{type(tensor).__name__}, a tensor class the offload store cannot keep; the offload hook "
                         f"would load the old value over it. Keep that module in memory (device_map).")
    import torch

    overlay = overlay_of(hook)
    for name, tensor in replaced:
        untie(module, name, tensor)
        value = tensor.detach()
        if value.is_inference():
            with torch.inference_mode(False):
                value = value.clone()
        overlay.kept[name] = value
        if tensor.requires_grad:
            if not _ADOPTED:
                from torch.utils.weak import WeakIdKeyDictionary

                _ADOPTED.append(WeakIdKeyDictionary())
            _ADOPTED[0][tensor] = describe(module, name)
