"""Every patch id has all its pieces where metapatch._framework.layout says they are: the record, its scenarios,
its own test file, its survey table, and its upstream diff (or, for a bug an upstream release already fixes, the
record says which: ``fixed_in`` or ``forwarded="not-needed"``). `metapatch scaffold` writes the first three and
the diff folder; this test names what is still missing."""

from __future__ import annotations

import importlib.util

import pytest

import metapatch
from metapatch._framework import layout

SHIPPED = sorted(metapatch.registry.patches.values(), key=lambda patch: patch.id)


@pytest.mark.parametrize("patch", SHIPPED, ids=lambda patch: patch.id)
def test_every_piece_is_where_the_id_says(patch):
    missing = []
    if importlib.util.find_spec(layout.patch_module(patch.id)) is None:
        missing.append(f"its record: {layout.patch_module(patch.id)}")
    scenarios = layout.scenarios(patch)
    if scenarios is None:
        missing.append(f"its scenarios: metapatch/selftest/{layout.stem(patch.id)}.py (or selftest= naming another's)")
    if not layout.test_file(patch.id).is_file():
        missing.append(f"its tests: tests/patches/{layout.test_file(patch.id).name}")
    if not layout.survey_table(patch.id).is_file():
        missing.append(f"its survey table: metapatch/survey/tables/{patch.id}.json (metapatch survey --run)")
    fixed_upstream = bool(patch.upstream.fixed_in) or patch.upstream.forwarded == "not-needed"
    if not layout.diffs(patch) and not fixed_upstream:
        missing.append(f"its upstream diff: upstream_diffs/{patch.id}/<package>.diff")
    assert not missing, f"{patch.id} lacks " + "; ".join(missing)


@pytest.mark.parametrize("patch", [p for p in SHIPPED if p.declared_selftest is None], ids=lambda patch: patch.id)
def test_own_scenarios_name_their_patch(patch):
    """A patch's own scenario module holds scenarios of that id (a copied module keeps the old id)."""
    module = importlib.import_module(layout.scenario_module(patch.id))
    ids = {scenario.patch_id for scenario in module.SCENARIOS}
    assert patch.id in ids, (patch.id, ids)
