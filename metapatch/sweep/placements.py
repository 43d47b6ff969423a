"""The offload placements the sweep loads every architecture with, derived from the module tree
of the in-memory model (no per-architecture names).

*Layer lists* are the outermost ``nn.ModuleList``s whose entries are of a class the model names in
``_no_split_modules`` (else the ``ModuleList`` holding the most parameters). The *top-level units*
are every other child of a module on the path from the root to a layer list (``model.embed_tokens``,
``model.norm``, ``lm_head``...), plus parameters and persistent buffers held directly by such a path module.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

PLACEMENTS = ("first-on-disk", "non-layers-on-disk", "alternate-layers-on-disk", "cpu-offload")

DESCRIPTIONS = {
    "first-on-disk": "the first top-level unit (module order; usually the input embedding) on disk",
    "non-layers-on-disk": "every top-level unit except the decoder/encoder layers on disk",
    "alternate-layers-on-disk": "layers 1, 3, 5... of every layer list on disk",
    "cpu-offload": "with a GPU: layers 1, 3, 5... on `cpu` (offloaded, the GPU executes); without one: "
                   "`accelerate.cpu_offload(model, execution_device='cpu')` on the in-memory model (every "
                   "weight on meta behind accelerate's hooks; a CPU main device never offloads `cpu` map entries)",
}


def _layer_lists(model: Any) -> List[str]:
    import torch

    no_split = set(getattr(model, "_no_split_modules", None) or ())
    found: List[str] = []
    best: Tuple[int, str] = (0, "")
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if any(name.startswith(f + ".") for f in found):
            continue
        if no_split and all(type(m).__name__ in no_split for m in module):
            found.append(name)
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best[0]:
            best = (size, name)
    if not found and best[1]:
        found.append(best[1])
    return found


def units(model: Any) -> Tuple[List[str], List[List[str]]]:
    """(top-level units, [layer names of each layer list])."""
    lists = _layer_lists(model)
    path = {""}
    for name in lists:
        parts = name.split(".")
        path.update(".".join(parts[:i]) for i in range(1, len(parts)))
    top: List[str] = []
    layers: Dict[str, List[str]] = {name: [] for name in lists}

    def walk(module: Any, prefix: str) -> None:
        for pname, _ in module.named_parameters(recurse=False):
            top.append(prefix + pname)
        # persistent buffers held by a path module (Bart's final_logits_bias): in the checkpoint, so in the map
        for bname, _ in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                top.append(prefix + bname)
        for cname, child in module.named_children():
            full = prefix + cname
            if full in layers:
                layers[full] = [f"{full}.{i}" for i, _ in enumerate(child)]
            elif full in path:
                walk(child, full + ".")
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                top.append(full)

    walk(model, "")
    return top, [layers[n] for n in lists]


def device_map(name: str, top: List[str], layer_lists: List[List[str]], main: Any) -> Dict[str, Any]:
    """The map of placement ``name``; ``{}`` where the architecture has nothing to place that way."""
    base: Dict[str, Any] = {unit: main for unit in top}
    for layers in layer_lists:
        base.update({layer: main for layer in layers})
    if name == "first-on-disk":
        if not top:
            return {}
        base[top[0]] = "disk"
    elif name == "non-layers-on-disk":
        if not top or not layer_lists:
            return {}
        base.update({unit: "disk" for unit in top})
    elif name in ("alternate-layers-on-disk", "cpu-offload"):
        moved = [layer for layers in layer_lists for layer in layers[1::2]]
        if not moved:
            return {}
        base.update({layer: "disk" if name.endswith("disk") else "cpu" for layer in moved})
    return base
