"""Which parameters are tied, and what a tied group costs (part of metapatch._offload.tied_groups, which
re-exports everything here).

* :func:`tied_groups` reads ties from what the model *declares* (transformers' regex-expanded
  ``all_tied_weights_keys``, for the outermost model and any nested one, e.g. under a PEFT
  wrapper) and from tensor identity, merged: a meta model built before ``tie_weights`` and a
  loaded model that is already tied give the same groups. The first name of a group is its
  *anchor* (the declared source): the member whose bytes are counted and whose device the others
  follow.
* :func:`dedupe_tied_sizes` makes a size table count each group exactly once, at its anchor.
* :func:`index_tied_members` gives every member of a group the offload-index entry of the one stored.

Import-cheap: nothing from torch or the Hugging Face stack at module level.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Mapping, MutableMapping, Optional, Sequence, Tuple

Group = Tuple[str, ...]


# ---------------------------------------------------------------------------------------------
# Which parameters are tied


def declared_mappings(model: Any) -> Iterable[Tuple[str, Mapping[str, str]]]:
    """(prefix, {target: source}) for every outermost module that declares expanded ties.

    transformers expands regex ``_tied_weights_keys`` once, in ``post_init``, into
    ``all_tied_weights_keys`` (submodels included), so reading it costs nothing; a module nested
    inside such a model is covered by its parent's mapping and skipped."""
    from metapatch._offload.module_walk import named_modules

    covered: List[str] = []
    for prefix, module in named_modules(model):
        if covered and (any(prefix == c or prefix.startswith(c + ".") for c in covered if c) or ("" in covered)):
            continue
        if _declares_nothing(module):
            continue
        mapping = _attribute(module, "all_tied_weights_keys")
        if mapping is None and callable(_attribute(module, "get_expanded_tied_weights_keys")):
            try:
                mapping = module.get_expanded_tied_weights_keys(all_submodels=True)
            except Exception:  # an exotic model whose expansion fails still gets identity ties
                mapping = None
        # typing's isinstance is slow (it was most of this walk, asked of every module): only for a value
        if mapping is not None and isinstance(mapping, Mapping) and mapping:
            covered.append(prefix)
            yield (prefix + "." if prefix else ""), mapping
            if not prefix:
                return  # the root's mapping covers every submodel


_DECLARING = ("all_tied_weights_keys", "get_expanded_tied_weights_keys")
_PLAIN_CLASSES: Dict[type, bool] = {}


def _declares_nothing(module: Any) -> bool:
    """Whether ``module`` has neither tie attribute, as :func:`_attribute` would find: its class (asked
    once per class: most modules of a model are a few classes) leaves lookup to torch and has neither,
    and the instance holds neither."""
    cls = type(module)
    plain = _PLAIN_CLASSES.get(cls)
    if plain is None:
        import torch

        plain = _PLAIN_CLASSES[cls] = cls.__getattr__ is torch.nn.Module.__getattr__ \
            and cls.__getattribute__ is object.__getattribute__ and not any(hasattr(cls, n) for n in _DECLARING)
    if not plain:
        return False
    state, parameters, buffers, children = module.__dict__, module._parameters, module._buffers, module._modules
    for name in _DECLARING:
        if name in state or name in parameters or name in buffers or name in children:
            return False
    return True


def _attribute(module: Any, name: str) -> Any:
    """``getattr(module, name, None)``. For a module whose class leaves attribute lookup to torch (no
    ``__getattr__``/``__getattribute__`` of its own) and that has no such attribute anywhere torch looks,
    None without a call of torch's ``__getattr__``, whose AttributeError (a formatted message each time)
    was most of the cost of reading ties from every module of a large model."""
    import torch

    cls = type(module)
    if cls.__getattr__ is torch.nn.Module.__getattr__ and cls.__getattribute__ is object.__getattribute__ \
            and not hasattr(cls, name) and name not in module.__dict__ and name not in module._parameters \
            and name not in module._buffers and name not in module._modules:
        return None
    return getattr(module, name, None)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: Dict[str, str] = {}

    def find(self, x: str) -> str:
        root = self.parent.setdefault(x, x)
        while root != self.parent[root]:
            root = self.parent[root]
        while x != root:  # path compression keeps later look-ups flat
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def all_parameters(model: Any) -> Iterable[Tuple[str, Any]]:
    """``model.named_parameters(remove_duplicate=False)``: same names, same order (pre-order, a
    module's own parameters before its children's). An explicit stack instead of torch's nested
    generators, whose cost grows with depth for every tensor; map inference walks them all."""
    stack = [("", model)]
    while stack:
        prefix, module = stack.pop()
        for name, param in module._parameters.items():
            if param is not None:
                yield prefix + name, param
        children = [(prefix + name + ".", child) for name, child in module._modules.items() if child is not None]
        stack.extend(reversed(children))


def tied_groups(model: Any, extra: Iterable[Sequence[str]] = (),
                parameters: Optional[Dict[str, Any]] = None) -> List[Group]:
    """Groups of parameter names that share one tensor (or will, once ``tie_weights`` runs).

    Linear in the number of parameters: declared pairs and identity are merged with a union-find,
    never by comparing every parameter with every other. ``parameters``, when given, is filled with
    every parameter by name (the walk is done anyway; callers need the tensors for their sizes)."""
    order: Dict[str, int] = {}
    first_by_identity: Dict[int, str] = {}
    uf = _UnionFind()
    for index, (name, param) in enumerate(all_parameters(model)):
        order[name] = index
        if parameters is not None:
            parameters[name] = param
        key = id(param)
        if key in first_by_identity:
            uf.union(first_by_identity[key], name)
        else:
            first_by_identity[key] = name
    declared_targets = set()
    for prefix, mapping in declared_mappings(model):
        for target, source in mapping.items():
            target, source = prefix + target, prefix + source
            if target in order and source in order and target != source:
                uf.union(source, target)
                declared_targets.add(target)
    for names in extra or ():
        present = [n for n in names if n in order]
        for other in present[1:]:
            uf.union(present[0], other)

    members: Dict[str, List[str]] = defaultdict(list)
    for name in order:
        if name in uf.parent:
            members[uf.find(name)].append(name)
    groups = []
    for names in members.values():
        if len(names) < 2:
            continue
        names.sort(key=order.__getitem__)
        anchor = next((n for n in names if n not in declared_targets), names[0])
        groups.append((anchor, *[n for n in names if n != anchor]))
    groups.sort(key=lambda g: order[g[0]])
    return groups


# ---------------------------------------------------------------------------------------------
# Sizes


def dedupe_tied_sizes(sizes: MutableMapping[str, int], groups: Sequence[Group],
                      tensor_bytes: Callable[[str], int]) -> MutableMapping[str, int]:
    """Count each tied group once, at its anchor, in a ``compute_module_sizes`` table that has an
    entry per tensor name as well as per module. Upstream tables count a group zero times (target
    seen first, then skipped by name), once, or once per member, depending on the tie state."""
    get = sizes.get
    # Corrections are summed per module and pushed up one level at a time, deepest first: each
    # module's entry is updated once, not once per tied member below it (hundreds of groups).
    by_depth: Dict[int, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for group in groups:
        counted = [int(get(member, 0)) for member in group]
        true_size = max(counted) or int(tensor_bytes(group[0]))
        for index, member in enumerate(group):
            delta = (true_size if index == 0 else 0) - counted[index]
            if delta:
                sizes[member] = get(member, 0) + delta
                parent = member.rpartition(".")[0]
                by_depth[parent.count(".") + 1 if parent else 0][parent] += delta
    for depth in range(max(by_depth, default=-1), -1, -1):
        for module, delta in by_depth[depth].items():
            if delta:
                sizes[module] = get(module, 0) + delta
                if depth:
                    by_depth[depth - 1][module.rpartition(".")[0]] += delta
    return sizes


def index_tied_members(index: MutableMapping[str, Any], model: Any) -> MutableMapping[str, Any]:
    """Give every member of a tied group the offload-index entry of any member that has one: the
    checkpoint stores a tied group once, so only that name is indexed, while each tied copy's
    offload hook looks up its own name."""
    for group in tied_groups(model):
        entry = next((index[m] for m in group if m in index), None)
        if entry is not None:
            for member in group:
                index.setdefault(member, entry)
    return index
