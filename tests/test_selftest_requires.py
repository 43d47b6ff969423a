"""Scenario(requires=..., unpatched=...): version expectations declared once on the scenario and judged
with the registry's own gate (pre-releases and local builds included, as for patches)."""

from __future__ import annotations

import pytest

from metapatch.selftest import Expect, Scenario, run_scenario, unmet


def test_unmet_reads_the_registry_gate():
    assert unmet({}) == ""
    assert unmet({"transformers": "<5.0.0.dev0"}, {"transformers": "4.57.1"}) == ""
    why = unmet({"transformers": "<5.0.0.dev0"}, {"transformers": "5.24.0"})
    assert why == "needs transformers<5.0.0.dev0 (installed: transformers 5.24.0)"
    # pre-releases and local builds count, as in Patch.affects
    assert unmet({"transformers": ">=5.0.0.dev0"}, {"transformers": "5.0.0rc1"}) == ""
    assert unmet({"accelerate": "<1.15.0.dev0"}, {"accelerate": "1.14.0+cu124"}) == ""
    assert "torch missing" in unmet({"torch": ">=2"}, {"torch": None})
    assert unmet({"a-dist": ">=1", "b-dist": "<2"}, {"a-dist": "1.0", "b-dist": "2.0"}).startswith("needs a-dist>=1, b-dist<2")


def test_expected_unpatched_first_match_then_the_gate():
    scenario = Scenario("p", "s", "m:f", expected_error="KeyError", expected_message="lm_head", unpatched=(
        Expect("SafetensorError", "disk", when={"transformers": "<5"}),
        Expect("", when={"transformers": ">=5.13"}),
    ))
    def expect(affected, version):
        found = scenario.expected_unpatched(affected, {"transformers": version})
        return found.error, found.message

    assert expect(True, "4.57.1") == ("SafetensorError", "disk")
    assert expect(True, "5.24.0") == ("", "")
    # no declared range matches: the patch's gate decides
    assert expect(True, "5.11.0") == ("KeyError", "lm_head")
    assert expect(False, "5.11.0") == ("", "")
    hash(scenario)  # the mappings do not make the record unhashable


def test_unmet_requires_is_na_in_the_child(tmp_path, monkeypatch):
    """The harness hands requires to the child, which reports n/a without calling the function (it
    would raise); met requires run it."""
    folder = tmp_path / "synthetic"
    folder.mkdir()
    (folder / "requires_scenarios.py").write_text(
        "def boom(workdir):\n    raise KeyError('called')\n")
    monkeypatch.setenv("PYTHONPATH", str(folder))
    monkeypatch.setenv("METAPATCH_SELFTEST_FORK", "0")  # fresh interpreters read PYTHONPATH
    never = Scenario("synthetic-patch", "never", "requires_scenarios:boom", requires={"packaging": "<0.1"})
    outcome = run_scenario(never, patched=False)
    assert outcome.error_type == "NotApplicable" and not outcome.passed
    assert outcome.not_applicable == never.not_applicable_here()
    assert outcome.not_applicable.startswith("needs packaging<0.1 (installed: packaging ")
    met = Scenario("synthetic-patch", "met", "requires_scenarios:boom", requires={"packaging": ">=0.1"})
    assert run_scenario(met, patched=False).error_type == "KeyError"


@pytest.mark.parametrize("module", ["tied_device_map_transformers_v4", "offloaded_model_device_v4"])
def test_release_line_shims_are_declarations(module):
    """The 4.57 scenarios are the 5.x functions declared with requires, not wrappers that check versions."""
    import importlib

    scenarios = importlib.import_module(f"metapatch.selftest.{module}").SCENARIOS
    assert scenarios and all(s.requires == {"transformers": "<5.0.0.dev0"} for s in scenarios)
    assert all(not s.function.startswith(f"metapatch.selftest.{module}:") for s in scenarios)
