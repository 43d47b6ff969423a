"""offloaded-dtype-conversion: ``model.to(torch.float16)``, ``model.to(dtype=...)``,
``model.to(memory_format=...)`` and ``model.to(<its own execution device>, dtype)`` on a model loaded with
``from_pretrained(device_map=...)`` and offloaded parts convert it, as ``model.half()`` already does;
upstream they raise accelerate's ``RuntimeError: You can't move a model that has some modules offloaded
to cpu or disk.`` although nothing would move.

``dispatch_model`` replaces the dispatched model's ``to`` by a guard that refuses any call while a
parameter is on meta. Past the guard (and for ``model.half()``, ``.float()``, ``.bfloat16()``,
``.double()``, which it does not see), torch converts only the meta placeholders; accelerate's hooks cast
each stored weight straight to its placeholder's dtype when they load it (``set_module_tensor_to_device``).
A single down-cast comes out right that way, but a chain does not: ``.to(torch.bfloat16).to(torch.float32)``
serves the stored fp32 value, skipping the bf16 rounding the in-memory model keeps, and ``save_pretrained``
(which reads offloaded tensors from the hooks' weights maps) writes them in the stored dtype after
``.half()``.

After transformers' dispatch (``accelerate_dispatch``), this patch puts a ``to`` in front of accelerate's
guard that lets through calls that move nothing (no device, or the device every tensor and every offload
hook already uses) as a pure dtype / memory-format conversion, and refuses every real device move with
``offloaded-move-guard``'s ``MetapatchError`` naming the offloaded weights (a ``RuntimeError`` too, as
accelerate's refusal was; a move to meta is still accelerate's guard's); ``half``/``float``/``bfloat16``/``double``
get the same conversion bookkeeping. On a GPU machine accelerate guards ``model.cuda`` the same way: it moves
nothing and returns the model where every tensor and hook is on that GPU already, as in memory. Each conversion records, in the offload store (:func:`metapatch._offload.store.
conversion`), the dtype every offloaded tensor whose placeholder it converted was converted to; the hook's
weights map (an ``Overlay``) then serves ``stored.to(d1).to(d2)...`` per read, one tensor at a time, so
logits, ``save_pretrained`` and ``state_dict()`` dtypes equal the in-memory model's. Nothing is loaded as a
whole and no file is written. A conversion of a submodule below the module its hook sits on (a part of an
offloaded block) is recorded where torch sets the marked placeholder's ``.data`` (``offloaded-placeholder-writes``);
this patch's own bookkeeping sees the placeholders under the converted module's own hooks. The methods put on the
model are objects a deep copy of the model binds to the copy (a closure would keep converting
the original).
"""

from __future__ import annotations

import sys
from typing import Any

from metapatch._framework.calls import signature_of
from metapatch._offload.hook_state import compute_device, offload_hooks
from metapatch._offload.store import conversion
from metapatch._framework.records import Patch, Target, Upstream
from metapatch.patches.offloaded_move_guard import refuse_offloaded_move

PATCH_ID = "offloaded-dtype-conversion"
_MARK = "_metapatch_conversion_to"


def _normalised(torch: Any, device: Any) -> Any:
    if isinstance(device, int):
        device = torch.device("cuda", device)  # accelerate's execution devices: an int is an accelerator index
    device = torch.device(device)
    if device.type not in ("cpu", "meta") and device.index is None:
        backend = getattr(torch, device.type, None)
        device = torch.device(device.type, backend.current_device() if hasattr(backend, "current_device") else 0)
    return device


def _moves_nothing(model: Any, device: Any) -> bool:
    """Whether every tensor in memory and every offload hook's execution device is ``device`` already."""
    torch = sys.modules["torch"]
    device = _normalised(torch, device)
    for module in model.modules():
        for hook in offload_hooks(module):
            if _normalised(torch, compute_device(hook)) != device:
                return False
    return all(_normalised(torch, t.device) == device for t in (*model.parameters(), *model.buffers()) if not t.is_meta)


class _OnModel:
    """A method put on one model instance (its ``__dict__``). A callable object rather than a closure: a deep copy
    of the model (``copy.deepcopy``, how a reference model for DPO/PPO is made) copies it bound to the copy (the
    model is in ``memo`` before its ``__dict__``), where a closure would keep converting the original (measured:
    ``copy.to(torch.bfloat16)`` converted the original model's offloaded weights and left the copy's alone)."""

    _accelerate_added_attribute = True  # removed with the hooks (remove_hook_from_module), as accelerate's guard is

    def __init__(self, model: Any, wrapped: Any) -> None:
        self.model = model
        self.__wrapped__ = wrapped
        setattr(self, _MARK, True)

    def __deepcopy__(self, memo: Any) -> Any:
        import copy

        copied = copy.copy(self)
        copied.model = memo.get(id(self.model), self.model)
        copied.__wrapped__ = copy.deepcopy(self.__wrapped__, memo)  # a bound method: bound to the copy
        return copied


class _ConversionTo(_OnModel):
    """A ``to`` for ``model`` that converts without moving, and leaves moves to accelerate's guard (``__wrapped__``:
    it refuses them as upstream)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch = sys.modules["torch"]
        guard = self.__wrapped__
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except Exception:
            return guard(*args, **kwargs)  # bad arguments: accelerate/torch raise their own error
        if device is not None and not _moves_nothing(self.model, device):
            # a real move: refused with metapatch's error naming the offloaded weights (a MetapatchError, and a
            # RuntimeError as accelerate's refusal is); a move to meta, or with nothing offloaded any more, is
            # accelerate's guard's to decide
            refuse_offloaded_move(self.model, "to", args, kwargs, str(device), PATCH_ID)
            return guard(*args, **kwargs)
        convert = {}
        if dtype is not None:
            convert["dtype"] = dtype
        if memory_format is not None:
            convert["memory_format"] = memory_format
        if not convert:
            return self.model
        with conversion(self.model):
            return type(self.model).to(self.model, **convert)


class _AcceleratorMove(_OnModel):
    """``model.cuda()`` (and the other accelerators' methods), which accelerate's dispatch guards as it guards ``to``:
    where every tensor in memory and every offload hook is on that device already it moves nothing and returns the
    model, as in memory; a real move is refused with metapatch's error (upstream: accelerate's ``RuntimeError``)."""

    def __init__(self, model: Any, wrapped: Any, kind: str) -> None:
        super().__init__(model, wrapped)
        self.kind = kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch = sys.modules["torch"]
        index = args[0] if args else kwargs.get("device")
        try:
            device = torch.device(self.kind) if index is None else (
                torch.device(self.kind, index) if isinstance(index, int) else torch.device(index))
        except Exception:
            return self.__wrapped__(*args, **kwargs)  # bad arguments: accelerate/torch raise their own error
        if _moves_nothing(self.model, device):
            return self.model
        refuse_offloaded_move(self.model, self.kind, args, kwargs, str(device), PATCH_ID)
        return self.__wrapped__(*args, **kwargs)


class _Converting(_OnModel):
    """``model.<method>`` (``half``, ``float``, ...: accelerate does not guard them), converting the offloaded
    tensors' stored values too (``__wrapped__``: the model's own method)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with conversion(self.model):
            return self.__wrapped__(*args, **kwargs)


def conversion_to(model: Any, guard: Any) -> Any:
    """A ``to`` for ``model`` that converts without moving, and leaves moves to accelerate's ``guard``."""
    return _ConversionTo(model, guard)


def converting(model: Any, method: str) -> Any:
    """``model.<method>``, converting the offloaded tensors' stored values too."""
    return _Converting(model, getattr(type(model), method).__get__(model))


_CONVERSIONS = ("half", "float", "bfloat16", "double")


def install_on(model: Any) -> None:
    guard = model.__dict__.get("to") if model is not None else None
    if guard is None or getattr(guard, _MARK, False) or getattr(guard, "__wrapped__", None) is None:
        return  # not dispatched with offload (accelerate added no guard), or already done
    model.__dict__["to"] = conversion_to(model, guard)
    for method, guarded in list(model.__dict__.items()):  # model.cuda() where accelerate guards it (a GPU machine)
        if method != "to" and getattr(guarded, "_accelerate_added_attribute", False) \
                and not getattr(guarded, _MARK, False) and callable(getattr(type(model), method, None)):
            model.__dict__[method] = _AcceleratorMove(model, guarded, method)
    for method in _CONVERSIONS:
        if method not in model.__dict__ and callable(getattr(type(model), method, None)):
            model.__dict__[method] = converting(model, method)


def _accelerate_dispatch(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    install_on(signature_of(wrapped).bind_partial(*args, **kwargs).arguments.get("model"))
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="dtype and memory-format conversions of a from_pretrained model with offloaded parts convert it "
          "(a real device move stays refused)",
    # accelerate's guard refuses every .to of a model with meta parameters in every release; the patch
    # sits on transformers' dispatch, which exists as accelerate_dispatch from 5.0.
    affects={"transformers": ">=5.0", "accelerate": ">=1.0"},
    targets=(
        Target("transformers.integrations.accelerate", "accelerate_dispatch",
               fingerprints=("d829b4ec714812a9",  # transformers 5.0.0 - 5.15.1
                             "489099a5f1b7ec66"),  # transformers 5.16.0 - 5.24.0
               wrapper=_accelerate_dispatch, aliases=("transformers.modeling_utils:accelerate_dispatch",)),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues?q=You+can%27t+move+a+model+that+has+some+modules+offloaded",),
        forwarded="no",
        note="accelerate: dispatch_model's guard on model.to refuses only calls that move a tensor; dtype and "
             "memory-format conversions go through (the hooks cast offloaded weights as they load them)",
    ),
)
