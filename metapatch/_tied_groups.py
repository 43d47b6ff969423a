"""Tied-parameter groups, and device maps that keep each group on one device.

Shared by the transformers and accelerate ``infer_auto_device_map`` patches (and the repair of
explicit maps), so both sides agree on what is tied and on what a tied group costs.

* :func:`tied_groups` reads ties from what the model *declares* (transformers' regex-expanded
  ``all_tied_weights_keys``, for the outermost model and any nested one, e.g. under a PEFT
  wrapper) and from tensor identity, merged: a meta model built before ``tie_weights`` and a
  loaded model that is already tied give the same groups. The first name of a group is its
  *anchor* (the declared source): the member whose bytes are counted and whose device the others
  follow.
* :func:`dedupe_tied_sizes` makes a size table count each group exactly once, at its anchor.
* :class:`Placement` takes a map computed as if nothing were tied and moves or refines entries
  until every group sits on one device, never past a device's budget.

Import-cheap: nothing from torch or the Hugging Face stack at module level.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, defaultdict
from functools import cached_property
from itertools import islice
from typing import Any, Callable, Dict, Iterable, List, Mapping, MutableMapping, Optional, Sequence, Tuple

Group = Tuple[str, ...]


class TiedGroupsSplitWarning(UserWarning):
    """An explicit device_map put members of one tied group on different devices; metapatch moved the
    tied copies to their source's device (the message names the pairs)."""


# ---------------------------------------------------------------------------------------------
# Which parameters are tied


def _declared_mappings(model: Any) -> Iterable[Tuple[str, Mapping[str, str]]]:
    """(prefix, {target: source}) for every outermost module that declares expanded ties.

    transformers expands regex ``_tied_weights_keys`` once, in ``post_init``, into
    ``all_tied_weights_keys`` (submodels included), so reading it costs nothing; a module nested
    inside such a model is covered by its parent's mapping and skipped."""
    covered: List[str] = []
    for prefix, module in model.named_modules():
        if any(prefix == c or prefix.startswith(c + ".") for c in covered if c) or ("" in covered):
            continue
        mapping = getattr(module, "all_tied_weights_keys", None)
        if mapping is None and callable(getattr(module, "get_expanded_tied_weights_keys", None)):
            try:
                mapping = module.get_expanded_tied_weights_keys(all_submodels=True)
            except Exception:  # an exotic model whose expansion fails still gets identity ties
                mapping = None
        if isinstance(mapping, Mapping) and mapping:
            covered.append(prefix)
            yield (prefix + "." if prefix else ""), mapping
            if not prefix:
                return  # the root's mapping covers every submodel


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
    for prefix, mapping in _declared_mappings(model):
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


# ---------------------------------------------------------------------------------------------
# Placement


def entry_of(device_map: Mapping[str, Any], name: str) -> Optional[str]:
    """The device-map key that places ``name`` (longest dotted prefix, as accelerate reads maps)."""
    key = name
    while True:
        if key in device_map:
            return key
        cut = key.rfind(".")
        if cut < 0:
            return "" if "" in device_map else None
        key = key[:cut]


class Placement:
    """A device map being repaired so that each tied group sits on one device.

    ``budgets`` (bytes per device; "disk" unlimited) and ``sizes`` (tie-deduplicated) make every
    move respect the budgets; without them (an explicit user map) moves are free. Tied members
    follow their anchor; when that would overflow a budget, the whole group goes to the slowest
    device involved that has room, or to disk."""

    def __init__(self, model: Any, device_map: Mapping[str, Any], groups: Sequence[Group], *,
                 sizes: Optional[Mapping[str, int]] = None, budgets: Optional[Mapping[Any, int]] = None,
                 devices: Optional[Sequence[Any]] = None, no_split: Iterable[str] = (),
                 parameter_names: Optional[Iterable[str]] = None) -> None:
        self.model = model
        # Every parameter name (as all_parameters names them), when the caller has walked them
        # already: counting the parameters under a key is then a range of a sorted list (sorted on
        # first use, like the indexes below).
        self._given_parameter_names = parameter_names
        self.map: Dict[str, Any] = dict(device_map)
        self.groups = [g for g in groups if len(g) > 1]
        self.sizes = sizes if sizes is not None else {}
        self.budgets = dict(budgets) if budgets is not None else None
        ordered = list(devices) if devices is not None else []
        for device in list(self.map.values()) + ["disk"]:
            if device not in ordered:
                ordered.append(device)
        self.rank = {device: i for i, device in enumerate(ordered)}
        self.no_split = set(no_split or ())
        self.used: Dict[Any, int] = defaultdict(int)
        for key, device in self.map.items():
            self.used[device] += self.sizes.get(key, 0)
        self.moves: List[Tuple[str, str, Any, Any]] = []  # (member, anchor, from, to) for messages
        # name -> the map key placing it, and the reverse. Moving a key to another device keeps every
        # entry; a split replaces one key by its children, so only the names it placed are looked up
        # again. A repair asks for the same members' devices thousands of times.
        self._entries: Dict[str, Optional[str]] = {}
        self._placed_by: Dict[Optional[str], List[str]] = defaultdict(list)

    # The indexes below are built on first use: most maps need no repair (or only a few moves), and
    # building them walks every module and parameter of the model, which would double the cost of
    # map inference on large models (benchmarks/bench_tied_device_map.py).

    @cached_property
    def group_of(self) -> Dict[str, int]:
        return {member: index for index, group in enumerate(self.groups) for member in group}

    @cached_property
    def _parameter_names(self) -> Optional[List[str]]:
        names = self._given_parameter_names
        return sorted(names) if names is not None else None

    @cached_property
    def _sorted_members(self) -> List[str]:
        return sorted(member for group in self.groups for member in group)

    def members_under(self, key: str) -> List[str]:
        """Tied members at or below ``key``: a range of the sorted names ("/" sorts right after ".")."""
        names = self._sorted_members
        if not key:
            return list(names)
        inside = names[bisect_left(names, key + "."):bisect_left(names, key + "/")]
        return inside + [key] if key in self.group_of else inside

    # -- reading -----------------------------------------------------------------------------

    def _entry(self, name: str) -> Optional[str]:
        try:
            return self._entries[name]
        except KeyError:
            key = self._entries[name] = entry_of(self.map, name)
            self._placed_by[key].append(name)
            return key

    def device(self, name: str) -> Any:
        key = self._entry(name)
        return None if key is None else self.map[key]

    def violations(self) -> List[int]:
        """Indexes of the groups whose members sit on more than one device (members the map does
        not place are ignored). Runs over every group at least twice per repair: written flat."""
        entries, placed, entry, out = self._entries, self.map, self._entry, []
        for index, group in enumerate(self.groups):
            first = None
            for member in group:
                key = entries[member] if member in entries else entry(member)
                if key is None:
                    continue
                device = placed[key]
                if first is None:
                    first = device
                elif device != first:
                    out.append(index)
                    break
        return out

    def _split_now(self, group: Group) -> bool:
        """One group's check of :meth:`violations` (which is written flat for its full passes)."""
        devices = {self.device(m) for m in group}
        devices.discard(None)
        return len(devices) > 1

    def _fits(self, device: Any, extra: int) -> bool:
        if self.budgets is None or device == "disk" or extra <= 0:
            return True
        budget = self.budgets.get(device)
        return budget is not None and self.used[device] + extra <= budget

    def _is_tensor(self, key: str) -> bool:
        if key == "" or self._module(key) is not None:
            return False
        module = self._module(key.rpartition(".")[0])
        leaf = key.rpartition(".")[2]
        return module is None or leaf in module._parameters or leaf in module._buffers

    def _module(self, key: str) -> Any:
        try:
            return self.model.get_submodule(key)
        except AttributeError:
            return None

    # -- changing ----------------------------------------------------------------------------

    def _set(self, key: str, device: Any) -> None:
        old = self.map[key]
        if old == device:
            return
        size = self.sizes.get(key, 0)
        self.used[old] -= size
        self.used[device] += size
        self.map[key] = device

    def _split(self, key: str) -> bool:
        """Replace ``key`` by its direct parameters, children and buffers, all on its device."""
        if self._is_tensor(key):
            return False
        module = self._module(key)
        prefix = key + "." if key else ""
        children = [n for n, _ in module.named_parameters(recurse=False)] + \
            [n for n, _ in module.named_children()] + [n for n, _ in module.named_buffers(recurse=False)]
        if not children:
            return False
        device = self.map[key]
        rebuilt: Dict[str, Any] = {}
        for k, v in self.map.items():
            if k == key:
                for child in children:
                    rebuilt.setdefault(prefix + child, device)
            else:
                rebuilt[k] = v
        self.map = rebuilt
        for name in self._placed_by.pop(key, ()):  # a longer key can only appear under the split one
            self._entries.pop(name, None)
        return True

    def _splittable(self, key: str) -> bool:
        """Whether ``key`` may be replaced by finer entries. A leaf module (no child modules) never is:
        accelerate hooks modules, so a leaf whose weight and bias sat on two devices would keep the
        offloaded one on meta with no hook to load it (a tied head with a bias beside an offloaded
        embedding). Such a leaf moves whole."""
        if self._is_tensor(key):
            return False
        module = self._module(key)
        if module is None or not module._modules:
            return False
        return type(module).__name__ not in self.no_split

    def _movable(self, key: str, home: Any) -> bool:
        """``key`` may move to ``home`` without dragging any group anywhere it does not belong: every
        tied member inside it either has its whole group inside too, or is a non-anchor whose
        anchor already lives on ``home``."""
        inside = set(self.members_under(key))
        for index in {self.group_of[m] for m in inside}:
            group = self.groups[index]
            if all(m in inside for m in group):
                continue
            anchor = group[0]
            if anchor in inside or self.device(anchor) != home:
                return False
        return True

    def _only_tied(self, key: str) -> bool:
        """Every parameter under ``key`` is a tied member: moving it moves nothing else (but buffers)."""
        members = len(self.members_under(key))
        if self._is_tensor(key):
            return members == 1
        names = self._parameter_names
        if names is not None:
            inside = len(names) if not key else bisect_left(names, key + "/") - bisect_left(names, key + ".")
            return inside == members
        # Counting stops one past the members: a decoder layer holds far more than its tied copies.
        return sum(1 for _ in islice(all_parameters(self._module(key)), members + 1)) == members

    def _follow(self, member: str, home: Any) -> bool:
        """Move ``member`` (a non-anchor) to ``home``, refining its map entry as far as needed: whole
        entries move only when they hold nothing but tied copies, so untied neighbours stay put."""
        while True:
            key = self._entry(member)
            if key is None or self.map[key] == home:
                return True
            movable = self._movable(key, home) and self._fits(home, self.sizes.get(key, 0))
            if movable and self._only_tied(key):
                self._set(key, home)
                return True
            if self._splittable(key) and self._split(key):
                continue
            if movable:
                self._set(key, home)
                return True
            return False

    def _isolate(self, member: str) -> str:
        """Split down to the smallest unit holding ``member`` that should not be split further."""
        while True:
            key = self._entry(member)
            if key is None or key == member or not self._splittable(key) or not self._split(key):
                return key

    def _demote(self, group: Group) -> None:
        keys = []
        for member in group:
            key = self._isolate(member)
            if key is not None and key not in keys:
                keys.append(key)
        slowest = max((self.map[k] for k in keys), key=lambda d: self.rank.get(d, len(self.rank)))
        for target in (slowest, "disk"):
            extra = sum(self.sizes.get(k, 0) for k in keys if self.map[k] != target)
            if self._fits(target, extra):
                for k in keys:
                    self._set(k, target)
                return

    def repair(self) -> Dict[str, Any]:
        """Make every group sit on one device and return the map (not cleaned)."""
        for _ in range(4 * len(self.groups) + 8):
            pending = self.violations()
            if not pending:
                return self.map
            for index in pending:
                group = self.groups[index]
                if not self._split_now(group):
                    continue  # an earlier move in this pass placed it (one layer moved fixes many groups)
                home = self.device(group[0])
                before = {m: self.device(m) for m in group}
                if all(self._follow(m, home) for m in group[1:] if self.device(m) not in (None, home)):
                    self.moves.extend((m, group[0], before[m], home) for m in group[1:] if before[m] != home)
                elif self._split_now(group):
                    self._demote(group)
                    after = self.device(group[0])
                    self.moves.extend((m, group[0], before[m], after) for m in group if before[m] != after)
        raise RuntimeError("metapatch could not place every tied group on a single device: "
                           f"{[self.groups[i][:2] for i in self.violations()[:5]]}")


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


def split_pairs_message(moves: Sequence[Tuple[str, str, Any, Any]], limit: int = 5) -> str:
    shown = [f"{member!r} (on {before}) is tied to {anchor!r}; both now on {after}"
             for member, anchor, before, after in moves[:limit]]
    more = f" and {len(moves) - limit} more" if len(moves) > limit else ""
    return "; ".join(shown) + more


def warn_split_groups(moves: Sequence[Tuple[str, str, Any, Any]], stacklevel: int = 4) -> None:
    if not moves:
        return
    message = ("metapatch: the device_map split tied parameter groups, which would leave the tied copies "
               "without a value (meta) after dispatch; they now read their source's value: "
               + split_pairs_message(moves))
    # One channel, at the user's line (not transformers' from_pretrained); ``stacklevel`` is unused.
    from ._warn import warn

    warn(message, TiedGroupsSplitWarning)


# ---------------------------------------------------------------------------------------------
# Checking a map (used by the reproducers and tests)


def bytes_per_device(model: Any, device_map: Mapping[str, Any], groups: Optional[Sequence[Group]] = None,
                     include_buffers: bool = True) -> Dict[Any, int]:
    """Bytes each device holds under ``device_map``, each tied tensor counted once (where its anchor is)."""
    groups = tied_groups(model) if groups is None else groups
    non_anchor = {m for g in groups for m in g[1:]}
    totals: Dict[Any, int] = defaultdict(int)
    tensors = [(n, t, True) for n, t in model.named_parameters(remove_duplicate=False)]
    if include_buffers:
        tensors += [(n, t, False) for n, t in model.named_buffers(remove_duplicate=False)]
    seen = set()
    for name, tensor, is_param in tensors:
        if name in non_anchor or name in seen:
            continue
        seen.add(name)
        key = entry_of(device_map, name)
        if key is None:
            if is_param:
                raise KeyError(f"{name} is not placed by the device map")
            continue  # accelerate leaves the buffers of split modules out of its maps
        totals[device_map[key]] += tensor.numel() * tensor.element_size()
    return dict(totals)


def map_is_sound(model: Any, device_map: Mapping[str, Any], groups: Sequence[Group],
                 budgets: Optional[Mapping[Any, int]]) -> bool:
    """Every tied group on one device and no device past its budget (tied tensors counted once).
    Used to keep upstream's own map wherever upstream got it right."""
    if split_groups(model, device_map, groups):
        return False
    try:
        used = bytes_per_device(model, device_map, groups)
    except KeyError:  # parameters deliberately left out of the map (transformers' no_placement_params)
        return True
    return all(used.get(device, 0) <= budget for device, budget in (budgets or {}).items() if device != "disk")


def upstream_map_if_sound(wrapped: Callable, args: tuple, kwargs: dict, max_memory: Any, model: Any,
                          groups: Sequence[Group]) -> Optional[Dict[str, Any]]:
    """Upstream's own map where it is right (every tied group on one device, every budget kept),
    else None - also when upstream raises IndexError in get_module_size_with_ties, which it does
    once a group member is placed before its source."""
    try:
        device_map = wrapped(*args, **kwargs)
    except IndexError:
        return None
    budgets = wrapped.__globals__["get_max_memory"](dict(max_memory) if max_memory else None)
    return device_map if map_is_sound(model, device_map, groups, budgets) else None


def sources_come_first(groups: Sequence[Group], parameters: Mapping[str, Any]) -> bool:
    """Each group's source is the first of its names in module order: upstream's allocators then count
    it once and meet it before its copies (otherwise they raise IndexError or count it 0 times)."""
    position = {name: i for i, name in enumerate(parameters)}
    return all(position[g[0]] < min(position[m] for m in g[1:]) for g in groups)


def all_tied_identically(model: Any, groups: Sequence[Group], parameters: Mapping[str, Any]) -> bool:
    """Every group is already one tensor (what identity-based tie handling sees correctly)."""
    return all(all(parameters[m] is parameters[g[0]] for m in g[1:]) for g in groups)


def unplaced_parameters(model: Any, device_map: Mapping[str, Any]) -> List[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False) if entry_of(device_map, n) is None]


def split_groups(model: Any, device_map: Mapping[str, Any], groups: Optional[Sequence[Group]] = None) -> List[Group]:
    groups = tied_groups(model) if groups is None else groups
    return [g for g in groups if len({device_map[entry_of(device_map, m)] for m in g
                                      if entry_of(device_map, m) is not None}) > 1]


def ordered(device_map: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    return OrderedDict(device_map)


# ---------------------------------------------------------------------------------------------
# Running upstream's allocator on the tie-free problem


def clone_with_globals(func: Callable, overrides: Mapping[str, Any], also_clone: Sequence[str] = ()) -> Callable:
    """A private copy of ``func`` (and of the module functions named in ``also_clone``) that sees
    ``overrides`` instead of its module's globals. Nothing in the module changes, so concurrent
    callers of the real functions are unaffected."""
    import types

    namespace = dict(func.__globals__)
    namespace.update(overrides)

    def copy(f: Callable) -> Callable:
        new = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
        new.__kwdefaults__ = dict(f.__kwdefaults__) if f.__kwdefaults__ else None
        new.__qualname__ = f.__qualname__
        return new

    for name in also_clone:
        namespace[name] = copy(namespace[name])
    return copy(func)


def speed_order(devices: Iterable[Any]) -> List[Any]:
    """Accelerators (in index order) before mps, cpu, then disk."""
    def key(device: Any) -> Tuple[int, str]:
        text = str(device)
        if text == "disk":
            return (3, text)
        if text == "cpu":
            return (2, text)
        if text == "mps":
            return (1, text)
        return (0, text.rjust(8))
    unique: List[Any] = []
    for device in devices:
        if device not in unique:
            unique.append(device)
    return sorted(unique, key=key)
