"""Device maps repaired so that each tied group sits on one device (part of metapatch._offload.tied_groups,
which re-exports everything here).

:class:`Placement` takes a map computed as if nothing were tied and moves or refines entries until
every group sits on one device, never past a device's budget; an explicit map that split a group is
reported with :func:`warn_split_groups`.

Import-cheap: nothing from torch or the Hugging Face stack at module level.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from functools import cached_property
from itertools import islice
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .device_names import norm_device
from .tied_members import Group, all_parameters


class TiedGroupsSplitWarning(UserWarning):
    """An explicit device_map put members of one tied group on different devices; metapatch moved the
    tied copies to their source's device (the message names the pairs)."""


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
                elif device != first and norm_device(device) != norm_device(first):  # 0 is "cuda:0"
                    out.append(index)
                    break
        return out

    def _split_now(self, group: Group) -> bool:
        """One group's check of :meth:`violations` (which is written flat for its full passes)."""
        devices = {norm_device(d) for d in (self.device(m) for m in group) if d is not None}
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
                    # every member may have moved, the first too: each is named beside another member, not itself
                    self.moves.extend((m, group[1] if m == group[0] else group[0], before[m], after)
                                      for m in group if before[m] != after)
        raise RuntimeError("metapatch could not place every tied group on a single device: "
                           f"{[self.groups[i][:2] for i in self.violations()[:5]]}")


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
    from .._framework.warn import warn

    warn(message, TiedGroupsSplitWarning)
