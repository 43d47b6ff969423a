"""Finding patch records: every ``PATCH`` in the modules of ``metapatch.patches``, eagerly
(:func:`load_patches`) or one module at a time when a record is first needed (:func:`lazy_patches`,
what ``import metapatch`` uses: the package's ``INDEX`` names each patch's target modules)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, List, Tuple

from .records import Patch


def load_patches(package: str = "metapatch.patches") -> List[Patch]:
    """Every ``PATCH`` record in the modules of ``package``, in file-name order."""
    import importlib

    pkg = importlib.import_module(package)
    records = []
    for name in _patch_module_names(pkg):
        module = importlib.import_module(f"{package}.{name}")
        patch = getattr(module, "PATCH", None)
        if isinstance(patch, Patch):
            records.append(patch)
    return records


def _patch_module_names(pkg: Any) -> List[str]:
    # A patch is a module (``name.py``) or, once it grows, a package of small modules (``name/``).
    return sorted({entry[:-3] if entry.endswith(".py") else entry
                   for folder in pkg.__path__ for entry in os.listdir(folder)
                   if not entry.startswith("_") and (entry.endswith(".py")
                                                     or os.path.isfile(os.path.join(folder, entry, "__init__.py")))})


class LazyPatches(Mapping):
    """Patch records by id, each patch module imported only when its record is first needed.

    Built from the package's ``INDEX`` (``{patch id: (module, target modules)}``): the registry
    registers import hooks from the index alone, so ``import metapatch`` imports no patch module;
    a target's import (or ``status()``) loads the record. Modules the index does not name are
    loaded at once, so a forgotten entry costs import time, never a patch."""

    def __init__(self, package: str, index: Dict[str, Tuple[str, Tuple[str, ...]]],
                 eager: Iterable[Tuple[str, Patch]] = ()):
        self._package = package
        self._index = dict(index)
        self._records: Dict[str, Patch] = {}
        module_of = {pid: entry[0] for pid, entry in self._index.items()}
        for module_name, patch in eager:  # (module name, record) of modules the index misses
            if patch.id in self._records or patch.id in self._index:
                raise ValueError(f"two patches share the id {patch.id!r}")
            self._records[patch.id] = patch
            module_of[patch.id] = module_name
        # file-name order, as load_patches
        self._order = sorted(set(self._index) | set(self._records), key=lambda pid: (module_of.get(pid, ""), pid))

    def modules_of(self, patch_id: str) -> Tuple[str, ...]:
        record = self._records.get(patch_id)
        return record.modules if record is not None else tuple(self._index[patch_id][1])

    def __getitem__(self, patch_id: str) -> Patch:
        record = self._records.get(patch_id)
        if record is None:
            module_name, targets = self._index[patch_id]  # KeyError for an unknown id, as a dict
            import importlib

            record = getattr(importlib.import_module(f"{self._package}.{module_name}"), "PATCH", None)
            if not isinstance(record, Patch) or record.id != patch_id:
                raise RuntimeError(f"{self._package}.INDEX[{patch_id!r}] does not match {self._package}.{module_name}"
                                   f".PATCH ({record!r}); update the index (tests/test_registry.py prints it)")
            # (Target modules that differ from the index: the record wins; the registry hooks the
            # record's modules when it applies it. tests/test_registry.py keeps the two equal.)
            self._records[patch_id] = record
        return record

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def index_of_records(package: str = "metapatch.patches") -> Dict[str, Tuple[str, Tuple[str, ...]]]:
    """The ``INDEX`` the records of ``package`` give (imports every patch module): what
    ``python -m metapatch.patches --write`` puts into the package's ``__init__.py``."""
    import importlib

    pkg = importlib.import_module(package)
    index = {}
    for name in _patch_module_names(pkg):
        patch = getattr(importlib.import_module(f"{package}.{name}"), "PATCH", None)
        if isinstance(patch, Patch):
            index[patch.id] = (name, patch.modules)
    return index


def render_index(index: Dict[str, Tuple[str, Tuple[str, ...]]]) -> str:
    return "INDEX = {\n" + "".join(f"    {pid!r}: {entry!r},\n" for pid, entry in index.items()) + "}\n"


def lazy_patches(package: str = "metapatch.patches") -> LazyPatches:
    """:func:`load_patches`, but patch modules listed in the package's ``INDEX`` load on demand."""
    import importlib

    pkg = importlib.import_module(package)
    names = _patch_module_names(pkg)
    index = {pid: (module, tuple(targets)) for pid, (module, targets) in getattr(pkg, "INDEX", {}).items()
             if module in names}  # an entry whose module was removed is ignored
    indexed = {module for module, _ in index.values()}
    eager = []
    for name in names:
        if name in indexed:
            continue
        patch = getattr(importlib.import_module(f"{package}.{name}"), "PATCH", None)
        if isinstance(patch, Patch):
            eager.append((name, patch))
    return LazyPatches(package, index, eager)
