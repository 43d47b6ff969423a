"""What is wrong with a loaded model's placement: the checks people otherwise do by hand after a crash.

``metapatch.diagnose(model)`` returns a :class:`Report` (``print(report)``, ``report.to_dict()``,
``report.to_json()``) with one :class:`Finding` per problem, each naming the parameters or modules
involved, the metapatch patch that fixes it (and that patch's state here) or the action to take:

* ``meta-unfilled``: parameters/buffers on meta that no accelerate offload hook will fill;
* ``no-hf-device-map``: the model is split across devices (or has meta/offloaded weights) but has
  no ``hf_device_map``;
* ``model-device-meta``: ``model.device`` is meta, so ``inputs.to(model.device)`` fails;
* ``tied-split``: tied parameters placed on different devices;
* ``skip-keys-missing``: accelerate hooks whose ``skip_keys`` omit the model's
  ``_skip_keys_device_placement`` (the cache gets moved between devices every forward);
* ``quant-state-meta``: bitsandbytes 4-bit quant states with tensors on meta;
* ``offloaded`` (info): modules whose weights live on CPU/disk behind offload hooks.

Nothing here changes the model. torch is imported only by the callers (the model exists). A finding
names the patch whose record lists its code in ``Patch.diagnoses``; the report's shape is
:mod:`metapatch.diagnose.report`, the reading of placements :mod:`metapatch._offload.model_placement`.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from typing import Any, Dict, List, Mapping, Optional

from .report import ERROR, INFO, WARNING, Finding, Report, with_patch
from .._offload.hook_state import align_hooks, execution_device
from .._offload.hook_state import storage as _storage
from .._offload.device_names import norm_device
from .._offload.model_placement import (collapse, covered_meta, device_map_owner, fully_offloaded_roots, join_name,
                                        tensor_placements, tied_groups_of)

def check_meta_unfilled(model: Any, covered: set) -> Optional[Finding]:
    names = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and n not in covered]
    if not names:
        return None
    tied = {m for group in tied_groups_of(model) for m in group}
    tied_hits = [n for n in names if n in tied]
    finding = Finding(
        "meta-unfilled", ERROR,
        f"{len(names)} parameter(s)/buffer(s) are on the meta device and no offload hook will load them: "
        "the first forward pass (or .item()) on them fails",
        names,
        fix=("the checkpoint did not provide them or the loader skipped them: read the loading report for "
             "missing keys, use the model class that matches the checkpoint, and pass device_map/max_memory that "
             "place every module (device_map='auto' leaves modules unplaced when tied weights are split)"))
    if tied_hits:
        finding.summary += f"; {len(tied_hits)} of them are tied weights"
        return with_patch(finding, "tied-split")  # the tie was split by the map: the map's repair fixes it
    return finding


def check_no_device_map(model: Any, placements: Mapping[str, str], offloaded: Mapping[str, Any]) -> Optional[Finding]:
    prefix, device_map = device_map_owner(model)
    if device_map is not None:
        return None
    devices = {d for d in placements.values()}
    hooked = any(align_hooks(m) for m in model.modules())
    if len(devices) < 2 and not offloaded and "meta" not in devices and not hooked:
        return None
    finding = Finding(
        "no-hf-device-map", WARNING,
        f"the model is {'split across ' + ', '.join(sorted(devices)) if len(devices) > 1 else 'dispatched'} "
        "but has no hf_device_map: device-map loading did not finish (or the model was dispatched by hand)",
        [],
        fix=("load with from_pretrained(..., device_map=...) so that transformers records hf_device_map; if that "
             "still leaves it out, the automatic map failed (often on regex tied weights): pass an explicit "
             "device_map dict naming every top-level module"))
    return with_patch(finding)


def check_model_device(model: Any) -> Optional[Finding]:
    try:
        device = getattr(model, "device", None)
    except Exception:
        return None
    if device is None or str(device) != "meta":
        return None
    target = _input_device(model)
    finding = Finding(
        "model-device-meta", ERROR,
        "model.device is meta (its first parameter is offloaded), so inputs.to(model.device) sends inputs to meta",
        [],
        fix=(f"import metapatch (offloaded-model-device makes model.device the execution device), or move inputs "
             f"to the input embeddings' execution device: inputs.to({target!r})"
             if target else "import metapatch (offloaded-model-device), or move inputs to the device that holds "
             "the input embeddings"))
    return with_patch(finding)  # (the -v4 sibling on transformers 4.57: whichever this install has)


def _input_device(model: Any) -> Optional[str]:
    get = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except Exception:
        embeddings = None
    if embeddings is None:
        return None
    for hook in align_hooks(embeddings):
        device = execution_device(hook)
        if device is not None:
            return norm_device(device)
    weight = getattr(embeddings, "weight", None)
    return None if weight is None or weight.is_meta else str(weight.device)


def check_tied_split(model: Any, placements: Mapping[str, str]) -> Optional[Finding]:
    split = []
    for group in tied_groups_of(model):
        where = {m: placements.get(m) for m in group if m in placements}
        if len(set(where.values())) > 1:
            split.append(" + ".join(f"{m} ({d})" for m, d in where.items()))
    if not split:
        return None
    finding = Finding(
        "tied-split", ERROR,
        f"{len(split)} tied group(s) are placed on different devices: the copies diverge or stay on meta",
        split,
        fix="put every member of a tied group on one device in the device_map (or let metapatch repair the map)")
    return with_patch(finding)


def _as_set(keys: Any) -> set:
    if keys is None:
        return set()
    return {keys} if isinstance(keys, str) else set(keys)


def check_skip_keys(model: Any) -> Optional[Finding]:
    wanted: set = set()
    for module in model.modules():
        wanted |= _as_set(getattr(type(module), "_skip_keys_device_placement", None))
    if not wanted:
        return None
    lacking: Dict[str, List[str]] = defaultdict(list)  # missing keys -> module names
    count = 0
    for name, module in model.named_modules():
        for hook in align_hooks(module):
            missing = wanted - _as_set(hook.skip_keys)
            if missing:
                lacking[", ".join(sorted(missing))].append(name)
                count += 1
                break
    if not lacking:
        return None
    items = [f"{n or '(model)'} lacks {keys}" for keys, names in lacking.items() for n in collapse(names)]
    finding = Finding(
        "skip-keys-missing", WARNING,
        f"{count} accelerate hook(s) do not skip the model's _skip_keys_device_placement "
        f"({', '.join(sorted(wanted))}): the cache is moved to each module's device every step",
        items,
        fix="dispatch with skip_keys=model._skip_keys_device_placement (re-dispatch by PEFT/dispatch_model drops it)")
    return with_patch(finding)


def _quant_state_meta(state: Any, depth: int = 0) -> List[str]:
    torch = sys.modules.get("torch")
    if torch is None or state is None or depth > 2:
        return []
    found = []
    for key, value in vars(state).items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            found.append(key)
        elif hasattr(value, "absmax") and hasattr(value, "blocksize"):  # nested QuantState (state2)
            found.extend(f"{key}.{k}" for k in _quant_state_meta(value, depth + 1))
    return found


def check_quant_state(model: Any, covered: set) -> Optional[Finding]:
    if "bitsandbytes" not in sys.modules:
        return None
    hits = []
    for name, module in model.named_modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        state = getattr(weight, "quant_state", None)
        if state is None:
            continue
        meta = _quant_state_meta(state)
        if meta:
            hits.append(f"{join_name(name, 'weight')}.quant_state: {', '.join(meta)}")
    if not hits:
        return None
    finding = Finding(
        "quant-state-meta", ERROR,
        f"{len(hits)} 4-bit weight(s) have quant-state tensors on meta: state_dict()/PEFT loading fails with "
        "\"Tensor.item() cannot be called on meta tensors\"",
        hits,
        fix="load with bnb_4bit_use_double_quant=False, or keep the quantized modules off CPU/disk offload")
    return with_patch(finding)


def offloaded_info(model: Any, covered: set, offloaded: Mapping[str, Any]) -> Optional[Finding]:
    if not offloaded:
        return None
    places = sorted({_storage(hook) for hook in offloaded.values()})
    roots = fully_offloaded_roots(model, covered)
    storage = {}
    for root in roots:
        owner = next((offloaded[m] for m in offloaded if root == "(model)" or m == root or m.startswith(root + ".")), None)
        storage[root] = _storage(owner) if owner is not None else places[0]
    # Counted as the user placed them (the map's entries: "model.layers.1"), not accelerate's hooks (one per
    # leaf module holding weights).
    listed = [f"{root} ({storage[root]})" for root in roots] or collapse(offloaded)
    finding = Finding(
        "offloaded", INFO,
        f"{len(listed)} module(s) ({len(covered)} tensors) keep their weights on {' and '.join(places)} and load "
        "them for each forward pass (expected with device_map offload)",
        listed,
        fix=("do not move this model with .to()/.cuda(); move only the inputs. For speed, give the GPU(s) more "
             "max_memory or use a smaller dtype/quantization"))
    return with_patch(finding)


def diagnose(model: Any) -> Report:
    """Inspect ``model`` (a torch module, a transformers model or a PeftModel) and report."""
    if not callable(getattr(model, "named_modules", None)):
        from .._framework.records import MetapatchError

        raise MetapatchError(f"metapatch.diagnose() takes a torch.nn.Module (a loaded model), got {type(model).__name__}")
    covered, offloaded = covered_meta(model)
    placements = tensor_placements(model)
    devices = Counter(str(p.device) for _, p in model.named_parameters())
    _, device_map = device_map_owner(model)
    report = Report(type(model).__name__, dict(sorted(devices.items())), device_map is not None)
    checks = (
        lambda: check_meta_unfilled(model, covered),
        lambda: check_no_device_map(model, placements, offloaded),
        lambda: check_model_device(model),
        lambda: check_tied_split(model, placements),
        lambda: check_skip_keys(model),
        lambda: check_quant_state(model, covered),
        lambda: offloaded_info(model, covered, offloaded),
    )
    for check in checks:
        finding = check()
        if finding is not None:
            report.findings.append(finding)
    return report


__all__ = ["Finding", "Report", "diagnose", "ERROR", "WARNING", "INFO"]


class _CallableModule(type(sys)):
    """``metapatch.diagnose`` names both this module and the function: importing the module (which the
    package's ``diagnose()`` does on its first call, as does ``from metapatch.diagnose import Report``) makes
    the module the package's attribute, and ``metapatch.diagnose(model)`` must still diagnose."""

    def __call__(self, model: Any) -> Report:
        return diagnose(model)


sys.modules[__name__].__class__ = _CallableModule
