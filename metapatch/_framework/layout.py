"""Where a patch's pieces are, found from its id: the one place that knows the convention.

A patch id (``offloaded-move-guard``; its stem ``offloaded_move_guard``, ``-`` as ``_``) names:

========================================  =========================================  =======================
``metapatch/patches/<stem>.py`` (or       the record (``PATCH``) and its replacement  :func:`patch_module`
a folder ``<stem>/``)
``metapatch/selftest/<stem>.py``          its reproducers (``SCENARIOS``)             :func:`scenario_module`
``upstream_diffs/<id>/``                  its upstream diffs, DEP-3 headers           :func:`diff_folder`
``metapatch/survey/tables/<id>.json``     its survey table                            :func:`survey_table`
``tests/patches/test_<stem>.py``          its tests (source checkout only)            :func:`test_file`
========================================  =========================================  =======================

A record holds none of this: :func:`diffs` and :func:`scenarios` derive what a record does not declare
(only a test's fake patch lists its diffs; only a patch exercised by another patch's scenarios names
their module). Import-cheap: ``pathlib`` only, and the diff folder's listing when asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

from .records import Patch

PACKAGE = Path(__file__).resolve().parents[1]  # metapatch/
SURVEY_TABLES = PACKAGE / "survey" / "tables"


def stem(patch_id: str) -> str:
    """The module name of a patch id: ``-`` as ``_``."""
    return patch_id.replace("-", "_")


def patch_module(patch_id: str) -> str:
    return f"metapatch.patches.{stem(patch_id)}"


def scenario_module(patch_id: str) -> str:
    return f"metapatch.selftest.{stem(patch_id)}"


def diff_folder(patch_id: str) -> Path:
    """``upstream_diffs/<id>/`` under the diffs root (``$METAPATCH_DIFFS_ROOT`` honoured)."""
    from .diff_files import diffs_root

    return diffs_root() / patch_id


def survey_table(patch_id: str) -> Path:
    return SURVEY_TABLES / f"{patch_id}.json"


def test_file(patch_id: str) -> Path:
    return PACKAGE.parent / "tests" / "patches" / f"test_{stem(patch_id)}.py"


test_file.__test__ = False  # a path helper, not a test (pytest collects ``test_*`` names it imports)


def diffs(patch: Patch) -> Tuple[str, ...]:
    """``upstream_diffs/<id>/<package>[-<N>-<slug>].diff`` paths of ``patch``, in series order: what its
    diff folder holds, unless the record lists them (a test's fake patch)."""
    if patch.declared_diffs is not None:
        return patch.declared_diffs
    from .diff_files import diff_paths_of

    return diff_paths_of(patch.id)


def scenarios(patch: Patch) -> Optional[str]:
    """The selftest module holding ``patch``'s reproducers: its own (``selftest/<stem>.py``), or the one
    the record names when another patch's scenarios exercise it; None when there is neither."""
    if patch.declared_selftest is not None:
        return patch.declared_selftest
    return scenario_module(patch.id) if (PACKAGE / "selftest" / f"{stem(patch.id)}.py").is_file() else None
