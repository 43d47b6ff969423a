"""The one walk of a module tree that metapatch's hot paths share (and, off them, every live module and the models
among them: :func:`live_modules`, :func:`live_instances`, :func:`roots`).

``torch.nn.Module.named_modules`` nests one generator per level (its cost grows with depth for every
module) and keeps its memo by hashing modules, which fails for a module class that defines ``__eq__``
without ``__hash__`` (a dataclass module), while torch itself never hashes a module it moves. Adapter
loads over an offloaded base, map inference and the move guard walk whole models several times.

Import-cheap: nothing from torch.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, List, Tuple


def named_modules(root: Any, remove_duplicate: bool = True, exclude: Iterable[Any] = ()) -> List[Tuple[str, Any]]:
    """``root.named_modules(remove_duplicate=...)``: the same names in the same order (pre-order), by
    an explicit stack, with modules told apart by identity. A module in ``exclude`` is neither listed nor
    entered (a tuner layer's modules without its base layer's)."""
    found, seen, stack = [], {id(module) for module in exclude}, [("", root)]
    while stack:
        name, module = stack.pop()
        if remove_duplicate or seen:
            if id(module) in seen:
                continue
            if remove_duplicate:
                seen.add(id(module))
        found.append((name, module))
        children = module._modules
        if children:
            prefix = name + "." if name else ""
            stack.extend(reversed([(prefix + child_name, child) for child_name, child in children.items()
                                   if child is not None]))
    return found


def modules(root: Any) -> List[Any]:
    """``list(root.modules())`` (pre-order, each module once, told apart by identity), without the
    names: for the passes that only look at the modules themselves."""
    found, seen, stack = [], set(), [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        children = module._modules
        if children:
            stack.extend(reversed([child for child in children.values() if child is not None]))
    return found


def submodule(root: Any, path: str) -> Any:
    """``root.get_submodule(path)``, read from ``_modules`` (a load names every adapter layer: torch's
    lookup checks each level with ``hasattr``/``getattr``); anything else is left to torch."""
    module = root
    if path:
        for part in path.split("."):
            child = module.__dict__.get("_modules", {}).get(part)
            if child is None:
                return root.get_submodule(path)
            module = child
    return module


def live_modules() -> List[Any]:
    """Every torch module alive in the process: for what must look at models it was never handed (a patch applied
    after a model was dispatched)."""
    torch = sys.modules.get("torch")
    return [] if torch is None else live_instances(torch.nn.Module)


def live_instances(cls: type) -> List[Any]:
    """Every live object of ``cls`` (or a subclass) the garbage collector tracks. A walk of every tracked object:
    asked once per late application of a patch, never on a hot path."""
    import gc

    # type(), not isinstance(): isinstance reads __class__, which some deprecated proxies warn about
    return [obj for obj in gc.get_objects() if issubclass(type(obj), cls)]


def roots(modules: Iterable[Any]) -> List[Any]:
    """The modules of ``modules`` that are no other one's child (the models, of a list of every live module)."""
    modules = list(modules)
    children = {id(child) for module in modules for child in module._modules.values() if child is not None}
    return [module for module in modules if id(module) not in children]
