"""offloaded-training-refusal: an optimizer step over trainable parameters that accelerate offloaded to
cpu/disk raises a :class:`~metapatch._framework.records.MetapatchError` instead of silently not training them.

Upstream (every accelerate release of the support window, measured on 1.13.0 and 1.16.0): an offloaded
parameter is a meta placeholder between forwards. Each forward, its module's hook loads a fresh copy from the
hook's ``weights_map``, the backward puts the gradient on that copy, and the hook drops the copy (with its
gradient) after the forward, putting a new placeholder in its place. The optimizer holds placeholders that never
get a gradient, so ``optimizer.step()`` updates only the parameters kept in memory: a plain loop with
``torch.optim.AdamW(model.parameters())`` or transformers' ``Trainer.train()`` runs, reports a falling loss, and
leaves every offloaded weight at its checkpoint value. Nothing says so.

Here, when an optimizer takes a parameter group (``Optimizer.add_param_group``, which ``Optimizer.__init__`` calls),
each trainable meta parameter that is at that moment a placeholder an accelerate offload hook serves is noted, by
identity, with its name (the hooks attached through ``add_hook_to_module`` are recorded; a placeholder of a hook
attached out of the recorder's sight, as transformers' ``resize_token_embeddings`` hangs the old head's hook on the
new head, makes one search of the live modules). A global optimizer step
pre-hook (torch's ``register_optimizer_step_pre_hook``, registered when the patch applies) checks each optimizer
once (again when its parameter count changes) before its first step: a noted placeholder that requires a gradient
and has none (or one still served at the step) makes the step raise :class:`OffloadedTrainingError` before
anything is updated, naming the offloaded trainable weights and what to do: freeze them
(``requires_grad_(False)``), train adapters with PEFT over the offloaded base, or load with a placement that keeps
the trainable tensors in memory.

A trainable tensor the program put in place of an offloaded one (``module.weight = nn.Parameter(v)``; the offload
store serves it from then on, ``offloaded-placeholder-writes``) is the same case: each forward loads a copy of it,
and the gradient never reaches the program's object; a step over it raises too.

Left alone: an optimizer with no such parameter (nothing offloaded, a frozen offloaded base under PEFT adapters,
an optimizer built over a model on meta that ``to_empty()`` materialised: byte-equal updates, the pre-hook returns
without touching anything); a meta parameter that has a gradient (a shape-only dry run on meta). Not seen: an
optimizer built before metapatch was imported and stepped after a forward that ran before the import (its
placeholders were replaced before the patch could note them; one built before the import is noted when the patch
applies), and a hand-written update loop (``param -= lr * param.grad``) calls no optimizer (its offloaded parameters have no
gradient, so it skips them).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Dict, List, Tuple

from metapatch._framework.records import MetapatchError, Patch, Target, Upstream
from metapatch._offload.replaced_weights import adopted_trainable

PATCH_ID = "offloaded-training-refusal"


class OffloadedTrainingError(MetapatchError):
    """An optimizer step would leave offloaded trainable parameters untrained."""


class _State:
    handle: Any = None  # torch's handle of the global step pre-hook (registered once per process)
    scanned = True  # whether modules hooked before the patch applied were looked for (or none can exist)


# Modules an offload hook was attached to (through add_hook_to_module): where placeholders are served from.
_OFFLOADING: "weakref.WeakSet[Any]" = weakref.WeakSet()
# optimizer -> how many parameters it had when it was found to hold no offloaded placeholder.
_CHECKED: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
# placeholder parameter -> its name, noted when an optimizer took it (a torch.utils.weak.WeakIdKeyDictionary:
# tensors compare by value, so only identity may key them)
_NOTED: Any = None


def _noted() -> Any:
    global _NOTED
    if _NOTED is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _NOTED = WeakIdKeyDictionary()
    return _NOTED


def _installed() -> bool:
    """Whether this patch is in place (the step pre-hook stays registered after an unpatch: it then does nothing)."""
    target = getattr(sys.modules.get("accelerate.hooks"), "add_hook_to_module", None)
    marker = getattr(target, "_self_metapatch", None)
    return bool(marker) and marker[0] == PATCH_ID


def _record(module: Any) -> None:
    from metapatch._offload.hook_state import offload_hooks

    if module is not None and offload_hooks(module):
        try:
            _OFFLOADING.add(module)
        except TypeError:  # an unhashable module: not recorded (its placeholders are not recognised)
            pass


def _scan_for_hooked_modules() -> None:
    """Modules hooked before the patch applied (metapatch imported after the model was dispatched): looked for
    once, and only when an optimizer holds a meta parameter without a gradient."""
    from metapatch._offload.hook_state import hooked_modules_alive

    _State.scanned = True
    for module in hooked_modules_alive():
        _record(module)


def _served() -> List[Tuple[str, Any]]:
    from metapatch._offload.hook_state import served_placeholders

    return [(name, param) for module in list(_OFFLOADING) for name, param in served_placeholders(module)
            if param.requires_grad]


def _served_by_id() -> Dict[int, str]:
    served = _served()
    if not served and not _State.scanned:
        _scan_for_hooked_modules()
        served = _served()
    return {id(param): name for name, param in served}


def _note_placeholders(params: List[Any]) -> None:
    """Note each trainable meta parameter of ``params`` that an offload hook serves right now (the hooks put a new
    placeholder in place after every forward: the optimizer keeps the one it took)."""
    meta = [p for p in params if getattr(p, "is_meta", False) and p.requires_grad]
    if not meta:
        return
    by_id = _served_by_id()
    if any(id(param) not in by_id for param in meta):
        _scan_for_hooked_modules()  # a hook the recorder did not see (see _offloaded_in); once per new group
        by_id = _served_by_id()
    noted = _noted()
    for param in meta:
        if id(param) in by_id:
            noted[param] = by_id[id(param)]


def _offloaded_in(candidates: List[Any]) -> List[str]:
    """The names of the offloaded trainable weights among ``candidates`` (meta, trainable, no gradient): noted when
    the optimizer took them, or still served now."""
    noted = _noted()
    names = [noted[p] for p in candidates if p in noted]
    if len(names) < len(candidates):
        by_id = _served_by_id()
        rest = [p for p in candidates if p not in noted]
        if any(id(p) not in by_id for p in rest):
            # A hook attached where the recorder did not see it (transformers' resize_token_embeddings builds a new
            # head and hangs the old head's hook on it): looked for once per optimizer, only when such a candidate is
            # left (a meta parameter without a gradient at its first step).
            _scan_for_hooked_modules()
            by_id = _served_by_id()
        names += [by_id[id(p)] for p in rest if id(p) in by_id]
    return names


def _shown(names: List[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _before_step(optimizer: Any, args: tuple, kwargs: dict) -> None:
    groups = optimizer.param_groups
    count = sum(len(group["params"]) for group in groups)
    if _CHECKED.get(optimizer) == count or not _installed():
        return None
    adopted = adopted_trainable() or {}
    candidates = [p for group in groups for p in group["params"]
                  if p.requires_grad and p.grad is None and (p.is_meta or p in adopted)]
    names = (_offloaded_in([p for p in candidates if p.is_meta])
             + [f"{adopted[p]} (a tensor put in place of the offloaded one)" for p in candidates if not p.is_meta])
    if not names:
        _CHECKED[optimizer] = count
        return None
    raise OffloadedTrainingError(
        f"metapatch: {type(optimizer).__name__}.step() over {len(names)} trainable parameter(s) whose "
        f"weights accelerate offloaded (to cpu or disk): {_shown(names)}. Between forwards they are placeholders on "
        f"the meta device; each forward loads a fresh copy from the offload store, the gradient lands on that copy "
        f"and is dropped with it, so the step would leave them untrained while the parameters in memory train. "
        f"Nothing was updated.\nWhat to do: freeze the offloaded weights (param.requires_grad_(False), e.g. for every "
        f"parameter with param.is_meta, before building the optimizer) and train adapters with PEFT over the "
        f"offloaded base (peft.get_peft_model(model, LoraConfig(...))), or load the model with a placement that keeps "
        f"every trainable tensor in memory (a device_map without 'cpu'/'disk' entries for them, or a larger "
        f"max_memory).\n(raised by metapatch patch {PATCH_ID!r}, METAPATCH_DISABLE={PATCH_ID} turns it off)")


def _register() -> None:
    if _State.handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _State.handle = register_optimizer_step_pre_hook(_before_step)


def _recording(original: Any) -> Any:
    """``add_hook_to_module`` that records the modules it gives an offload hook; applying the patch registers the
    step pre-hook (accelerate has imported torch by then)."""
    _register()
    hooks_module = sys.modules.get("accelerate.hooks")
    # Applied while accelerate.hooks is still executing (metapatch's import hook): no hook can exist unrecorded.
    # Applied later, hooks attached before may exist: looked for when an optimizer first needs them.
    _State.scanned = bool(getattr(getattr(hooks_module, "__spec__", None), "_initializing", False))

    @functools.wraps(original)
    def add_hook_to_module(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            _record(args[0] if args else kwargs.get("module"))
        except Exception:  # noqa: BLE001 - recording must never break a dispatch
            pass
        return result

    return add_hook_to_module


def _adopt_optimizers_built_before(module: Any) -> None:
    """Applied after a model was dispatched (``import metapatch`` late): an optimizer built before took placeholders
    that no ``add_param_group`` of ours noted, and the first forward replaces them (the optimizer keeps the old ones,
    which no hook serves from then on), so its step would go unrefused. Each live optimizer's trainable placeholders
    still served now are noted, as its ``add_param_group`` would have (one walk of the garbage collector's objects,
    on a late application only)."""
    import torch

    from metapatch._offload.module_walk import live_instances

    for optimizer in live_instances(torch.optim.Optimizer):
        for group in list(optimizer.param_groups):
            _note_placeholders(list(group["params"]))


def _add_param_group(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    if _OFFLOADING or not _State.scanned:  # no offload hook seen: nothing can be a placeholder
        try:
            _note_placeholders(list(instance.param_groups[-1]["params"]))
        except Exception:  # noqa: BLE001 - noting must never break building an optimizer
            pass
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="An optimizer step over trainable parameters accelerate offloaded to cpu/disk raises MetapatchError "
          "instead of silently leaving them untrained",
    # Measured: the reproducer trains the in-memory model and leaves the offloaded lm_head at its checkpoint value
    # on accelerate 1.13.0 (transformers 5.11.0) and 1.16.0 (5.25.0); no release refuses or trains it (the hooks
    # drop the onloaded copy with its gradient by design), so the range stays open.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        Target("accelerate.hooks", "add_hook_to_module",
               fingerprints=("a9b520badac922b7",),  # accelerate 1.13.0, 1.15.0, 1.16.0 (read from each release)
               replacement=_recording),
        Target("torch.optim.optimizer", "Optimizer.add_param_group",
               # torch 2.5-2.5.1, 2.6, 2.7-2.13, 2.14-2.15 (read from every release's wheel): 2.6 adds named
               # parameters, the rest are annotations; after the call every version's group holds plain tensors,
               # which is all the wrapper reads. Runs: 2.11.0, 2.13.0, 2.14.1 (selftest --all, CPU).
               fingerprints=("ae38374cfcc9bc26", "94008ee5b51f3e96", "6460aa1b3890d5ee", "af6056fb81f6bc5b"),
               wrapper=_add_param_group),
    ),
    adopt_existing=_adopt_optimizers_built_before,
    upstream=Upstream(
        bug=("https://github.com/huggingface/accelerate/issues?q=offload+training+gradient+meta",),
        forwarded="no",
        note="accelerate: an offload hook records its placeholders, and a global optimizer step pre-hook refuses "
             "a step over trainable offloaded parameters (they would never receive a gradient)",
    ),
)
