"""offloaded-move-guard: a clear error instead of "Cannot copy out of meta tensor; no data!" when a
model (or a submodule, or a PeftModel around it) whose weights accelerate offloaded to CPU/disk is
moved to a device.

accelerate keeps offloaded weights on the meta device and loads them from ``weights_map`` for each
forward pass. ``dispatch_model`` only guards the top-level ``model.to``/``model.cuda`` (instance
attributes), so ``model.model.to(...)``, ``torch.nn.Module.to(model, ...)``, ``model.cpu()`` and
``PeftModel.to(...)`` reach torch's raw error, whose advice (``to_empty()``) would throw the
offloaded weights away. The guard checks before anything is converted and raises only when the move
would certainly fail: a device move (not a dtype cast, not to meta) of a subtree holding a module
with an accelerate offload hook whose tensors are on meta. Everything else calls straight through.

The check walks the moved subtree, so it runs only once an offload hook can exist: a flag set by
``AlignDevicesHook.init_hook`` (the one place every accelerate offload hook is attached through,
``add_hook_to_module`` and ``SequentialHook`` alike) when the hook offloads. In a process that
never offloads, a ``.to`` costs one flag test. After that, which modules of a subtree carry an
offload hook is remembered until the next offload hook is attached anywhere or a submodule is
registered anywhere (torch's global module-registration hook): moving a model without offload hooks
again costs one lookup; for a hooked one only its hooked modules are checked (live: a removed hook,
or weights loaded back, count). A subtree changed behind torch's back (``parent._modules[name] =
hooked``) can be missed until the next such event; then torch raises its own "Cannot copy out of meta
tensor" error, as without the guard: the cache never lets through a move that would lose weights.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from typing import Any, Callable, List, Optional, Tuple

from metapatch._offload.hook_state import hooked, offload_hooks, storage
from metapatch._offload.module_walk import named_modules as _named_modules
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "offloaded-move-guard"


class OffloadedMoveError(MetapatchError, NotImplementedError):
    """Moving a module whose weights accelerate offloaded. A NotImplementedError too, so code that
    caught torch's "Cannot copy out of meta tensor" still catches this one."""


# -- which device a call moves to ------------------------------------------------------------


def _to_device(args: tuple, kwargs: dict) -> Optional[str]:
    torch = sys.modules["torch"]
    try:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
    except Exception:
        return None  # bad arguments: let torch raise its own error
    return None if device is None else str(device)


def _accelerator_device(kind: str) -> Callable[[tuple, dict], Optional[str]]:
    def target(args: tuple, kwargs: dict) -> Optional[str]:
        index = args[0] if args else kwargs.get("device")
        if index is None:
            return kind
        return str(index) if not isinstance(index, int) else f"{kind}:{index}"

    return target


def _cpu_device(args: tuple, kwargs: dict) -> Optional[str]:
    return "cpu"


# -- has any offload hook been attached? -------------------------------------------------------


class _OffloadSeen:
    """Whether an accelerate offload hook may exist in this process. ``seen`` only ever turns on:
    a hook that was detached, or whose model was deleted, leaves it on, and so does a copy of a
    hooked model (deepcopy, pickle), which never calls ``init_hook``. It starts on when the flag
    could have missed hooks: ``init_hook`` was wrapped after accelerate.hooks had finished
    importing (metapatch imported after accelerate, or re-installed after an unpatch)."""

    seen = False
    # Bumped whenever an offload hook is attached or a submodule registered: which modules of a
    # subtree are hooked is cached for the epoch it was computed in. The registration hook stays
    # after an unpatch (it only counts).
    epoch = 0
    registration_hook: Any = None


# root -> (epoch, the modules of its subtree that had an offload hook in that epoch). Whether
# those hooks still offload, and keep weights on meta, is read live on each device move.
_HOOKED_IN: "weakref.WeakKeyDictionary[Any, Tuple[int, Tuple[Any, ...]]]" = weakref.WeakKeyDictionary()


def _tree_changed(module: Any, name: str, submodule: Any) -> None:
    _OffloadSeen.epoch += 1


def _watch_module_registration() -> None:
    if _OffloadSeen.registration_hook is None:
        torch_module = sys.modules["torch.nn.modules.module"]
        _OffloadSeen.registration_hook = torch_module.register_module_module_registration_hook(_tree_changed)


def _track_offload_hooks(original: Any) -> Any:
    hooks_module = sys.modules.get("accelerate.hooks")
    spec = getattr(hooks_module, "__spec__", None)
    # While accelerate.hooks is still executing (metapatch's import hook runs then), no hook
    # instance can exist yet; any later install may come after hooks were attached unseen.
    if not getattr(spec, "_initializing", False):
        _OffloadSeen.seen = True
    _watch_module_registration()  # accelerate imports torch first: it is loaded here

    @functools.wraps(original)
    def init_hook(self: Any, module: Any) -> Any:
        if getattr(self, "offload", False):
            _OffloadSeen.seen = True
            _OffloadSeen.epoch += 1
        return original(self, module)

    return init_hook


# -- what is offloaded -------------------------------------------------------------------------


def _tensors(module: Any, recurse: bool = True) -> List[Any]:
    """The module's parameters and buffers (of its whole subtree with ``recurse``), walked by
    identity (see :func:`_named_modules`)."""
    modules = [m for _, m in _named_modules(module)] if recurse else [module]
    return [t for m in modules for group in (m._parameters, m._buffers) for t in group.values() if t is not None]


def _holds_meta(module: Any, recurse: bool) -> bool:
    return any(t.is_meta for t in _tensors(module, recurse))


def _offloaded_with_meta(module: Any) -> Optional[Any]:
    """The module's offload hook when it keeps the module's weights on meta right now (outside a
    forward pass), else None."""
    if not hooked(module):
        return None
    for offload_hook in offload_hooks(module):
        if _holds_meta(module, recurse=bool(getattr(offload_hook, "place_submodules", False))):
            return offload_hook
    return None


def _hooked_modules(root: Any) -> Tuple[Any, ...]:
    """The modules under ``root`` with an accelerate offload hook: cached per root and epoch."""
    if not root._modules:  # a leaf (most moves: PEFT moves every new adapter layer): no walk, no cache entry
        return (root,) if hooked(root) and offload_hooks(root) else ()
    epoch = _OffloadSeen.epoch
    try:
        entry = _HOOKED_IN.get(root)
    except TypeError:  # an unhashable module (a dataclass module with eq=True): not cached
        entry = None
    if entry is not None and entry[0] == epoch:
        return entry[1]
    found = tuple(m for _, m in _named_modules(root) if hooked(m) and offload_hooks(m))
    try:
        _HOOKED_IN[root] = (epoch, found)
    except TypeError:
        pass
    return found


def _any_offloaded(root: Any) -> bool:
    """Whether a module under ``root`` keeps offloaded weights on meta right now."""
    return any(_offloaded_with_meta(module) is not None for module in _hooked_modules(root))


def _offloaded_modules(root: Any) -> List[Tuple[str, Any, Any]]:
    """(relative name, module, hook) for every offloaded module under ``root``."""
    found = []
    for name, module in _named_modules(root):
        hook = _offloaded_with_meta(module)
        if hook is not None:
            found.append((name, module, hook))
    return found


def _collapsed_names(root: Any, offloaded: List[Tuple[str, Any, Any]]) -> List[str]:
    """The highest modules whose every tensor is offloaded: "layers.2" rather than its nine
    linears and norms."""
    offloaded_names = {name for name, _, _ in offloaded}

    def fully_offloaded(name: str, module: Any) -> bool:
        tensors = _tensors(module)
        return bool(tensors) and all(t.is_meta for t in tensors) and any(
            n == name or n.startswith(name + ".") or not name for n in offloaded_names)

    found: List[str] = []

    def visit(name: str, module: Any) -> None:
        if fully_offloaded(name, module):
            found.append(name or f"the whole {type(root).__name__}")
            return
        for child_name, child in module._modules.items():
            if child is None:
                continue
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", root)
    return found or sorted(offloaded_names)


def _caller() -> str:
    """The first frame outside torch.nn and this module: who asked for the move."""
    frame = sys._getframe(2)
    patches = os.path.dirname(__file__.rstrip("c"))  # this guard, or a patch that refuses through it
    while frame is not None:
        filename = frame.f_code.co_filename
        outside = os.path.dirname(filename) != patches and not filename.replace("\\", "/").endswith(
            "torch/nn/modules/module.py")
        if outside and frame.f_code.co_name not in _DEVICES:  # skip subclass overrides of .to/.cuda
            parts = filename.replace("\\", "/").split("/")
            short = "/".join(parts[-2:])
            return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "unknown"


def _refusal(root: Any, call: str, device: str, offloaded: List[Tuple[str, Any, Any]],
             patch_id: str = PATCH_ID) -> OffloadedMoveError:
    names = _collapsed_names(root, offloaded)
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    places = sorted({storage(hook) for _, _, hook in offloaded})
    return OffloadedMoveError(
        f"metapatch: {type(root).__name__}.{call} would move to {device} weights that accelerate "
        f"offloaded to {' and '.join(places)}: {shown}. Their parameters stay on the meta device and are "
        f"loaded only for each forward pass, so there is nothing to copy (torch would fail with \"Cannot "
        f"copy out of meta tensor; no data!\"). The model was left unchanged and still runs as dispatched.\n"
        f"What to do: choose the placement when loading, e.g. from_pretrained(..., device_map=\"{device}\") "
        f"when the model fits there, or device_map=\"auto\" with max_memory=...; to run the model, move "
        f"only the inputs: inputs.to(model.device). Do not use to_empty(): it would discard the offloaded "
        f"weights.\n(called from {_caller()}; raised by metapatch patch {patch_id!r}, "
        f"METAPATCH_DISABLE={patch_id} turns it off)")


def _refuse_if_offloaded(module: Any, method: str, args: tuple, kwargs: dict, device: str,
                         patch_id: str = PATCH_ID) -> None:
    if device.startswith("meta") or "accelerate.hooks" not in sys.modules or not _any_offloaded(module):
        return  # moving to meta never needs the data
    call = f"{method}({_call_args(args, kwargs)})"
    raise _refusal(module, call, device, _offloaded_modules(module), patch_id)


def refuse_offloaded_move(module: Any, method: str, args: tuple, kwargs: dict, device: str, patch_id: str) -> None:
    """Raise :class:`OffloadedMoveError` (this guard's refusal, naming ``patch_id``) when moving ``module`` to
    ``device`` would need weights accelerate offloaded: for a patch that stands in front of accelerate's own guard
    (``offloaded-dtype-conversion``), whose plain ``RuntimeError`` names neither the weights nor what to do."""
    _refuse_if_offloaded(module, method, args, kwargs, device, patch_id)


def _guard(method: str, target_device: Callable[[tuple, dict], Optional[str]]) -> Callable[[Any], Any]:
    # A plain function, not a wrapt proxy: .to is called very often and must stay a cheap call.
    def factory(original: Any) -> Any:
        @functools.wraps(original)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Which modules are hooked first (a cached lookup): parsing .to's arguments costs more.
            if _OffloadSeen.seen and _hooked_modules(self):
                device = target_device(args, kwargs)
                if device is not None:
                    _refuse_if_offloaded(self, method, args, kwargs, device)
            return original(self, *args, **kwargs)

        return guarded

    return factory


def _call_args(args: tuple, kwargs: dict) -> str:
    return ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])


_MODULE = "torch.nn.modules.module"
_FINGERPRINTS = {
    # torch 2.5-2.7, 2.8-2.9, 2.10-2.14 and 2.15 (read from every release's wheel; `to` is the same in
    # 2.5-2.9): the differences are annotations (``self: T -> T`` to ``Self``, ``Optional`` to ``|``), a
    # warning's stacklevel and, in 2.15, the wording of the meta-tensor error ``to`` re-raises; the guard
    # calls the original unchanged. Runs: torch 2.11.0, 2.13.0, 2.14.1 (selftest --all, CPU).
    "to": ("3440abf713e8cb18", "d370dbc824384755", "2283ae7937624f2d"),
    "cuda": ("24e8c8a2c57d39d7", "d846f94d0d86f174", "5717f31067ea014b"),
    "cpu": ("52869d7262262951", "5f2d30e3d3ed02a5"),
    "xpu": ("40b9eb2b39f265ab", "72078602a2ad80f0", "d0bc827a24b4ad12"),
    "ipu": ("6deb11a2f96e9bce", "c5ff5400f04ffbbc", "11bb7e5336831f03"),
    "mtia": ("f404dcd21cd6ac6a", "6315b7587d736f85", "30bc47bf1b0766bd"),
}
_DEVICES = {
    "to": _to_device,
    "cuda": _accelerator_device("cuda"),
    "cpu": _cpu_device,
    "xpu": _accelerator_device("xpu"),
    "ipu": _accelerator_device("ipu"),
    "mtia": _accelerator_device("mtia"),
}

# accelerate.hooks.AlignDevicesHook.init_hook: the same source in every release of the support window
# (declared once, shared with offloaded-placeholder-writes).
_INIT_HOOK_FINGERPRINTS = shared_fingerprints("accelerate.hooks:AlignDevicesHook.init_hook")

PATCH = Patch(
    id=PATCH_ID,
    title="Clear error when a model with accelerate-offloaded weights (or a submodule, or a PeftModel) is moved to a device",
    # accelerate's own guard (instance attributes set by dispatch_model) covers only the top-level
    # model.to/.cuda. Measured: move-offloaded-submodule and move-offloaded-peft-model fail
    # unpatched with torch's raw "Cannot copy out of meta tensor" and pass patched on accelerate
    # 1.10.0 (transformers 4.57.1), 1.10.1 (4.57.6), 1.11.0 (5.2.0), 1.12.0 (5.0.0), 1.13.0 (5.11.0),
    # 1.14.0 (4.57.6, 5.17.0) and 1.15.0 (5.24.0): from the bottom of the support window up. No
    # release guards more, so the range stays open.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        *(Target(_MODULE, f"Module.{method}", fingerprints=_FINGERPRINTS[method],
                 replacement=_guard(method, _DEVICES[method]))
          for method in ("to", "cuda", "cpu", "xpu", "ipu", "mtia")),
        Target("accelerate.hooks", "AlignDevicesHook.init_hook", fingerprints=_INIT_HOOK_FINGERPRINTS,
               replacement=_track_offload_hooks),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues?q=%22Cannot+copy+out+of+meta+tensor%22",),
        forwarded="no",
        note="upstream fix: offload hooks guard their module's _apply, so every path (submodule .to, "
             "Module.to(model), .cpu(), PeftModel.to, other accelerators) gets a clear error",
    ),
    diagnoses=("offloaded",),  # metapatch.diagnose findings this fixes
)
