"""metapatch.diffs and `metapatch diffs check`, on a synthetic installed package and synthetic
diffs (METAPATCH_DIFFS_ROOT points the commands at them), plus one run over the real
upstream_diffs/ folder that must agree with `metapatch status`."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import metapatch
from metapatch import Patch, Target, Upstream, diffs
from metapatch._framework.registry import Registry
from metapatch.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]

# The installed (buggy) source of the fake package; FIXED is what upstream's fix makes of it.
BUGGY = """\
\"\"\"A tiny stand-in for an upstream package.\"\"\"


def offload(tensor_bytes):
    total = 0
    for chunk in tensor_bytes:
        total += len(chunk)
    return total


def scale(x):
    # keep the meta device untouched
    factor = 2
    return x * factor


def tail():
    return "unchanged"
"""
FIXED = BUGGY.replace("    factor = 2\n", "    factor = 3\n")
DESCRIPTION = ("Description: Fix scale() on offloaded weights\n"
               " scale() multiplied by the wrong factor once weights were offloaded.\n"
               " .\n"
               " Second paragraph of the explanation.\n")


def git_diff(path: str, old: str, new: str) -> str:
    body = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "/dev/null" if not old else f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if not old else "") + body


def dep3(description: str = DESCRIPTION) -> str:
    return (description + "Origin: metapatch, metapatch/patches/fake_fix.py\n"
            "Bug: https://example.invalid/fake/issues/1\nForwarded: no\nApplied-Upstream: no\n"
            "Last-Update: 2026-11-29\n---\n")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """Install ``mpfake`` 1.2.0 (the buggy source) into a site dir first on sys.path."""
    site = tmp_path / "site"
    package = site / "mpfake"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core.py").write_text(BUGGY)
    info = site / "mpfake-1.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mpfake\nVersion: 1.2.0\n")
    (info / "top_level.txt").write_text("mpfake\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield site
    for name in [m for m in sys.modules if m == "mpfake" or m.startswith("mpfake.")]:
        del sys.modules[name]


@pytest.fixture
def diffs_root(tmp_path, monkeypatch):
    root = tmp_path / "upstream_diffs"
    root.mkdir()
    monkeypatch.setenv("METAPATCH_DIFFS_ROOT", str(root))
    return root


def write_diff(root: Path, patch_id: str, text: str, package: str = "mpfake") -> Path:
    path = root / patch_id / f"{package}.diff"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fix_diff(old: str = BUGGY, new: str = FIXED) -> str:
    test_file = "def test_scale_uses_three():\n    from mpfake.core import scale\n    assert scale(1) == 3\n"
    return dep3() + git_diff("src/mpfake/core.py", old, new) + git_diff("tests/test_core.py", "", test_file)


def set_installed(site: Path, source: str) -> Path:
    core = site / "mpfake" / "core.py"
    core.write_text(source)
    return core


# ---------------------------------------------------------------------------------------------
# parse / roots


def test_parse_reads_dep3_header_and_splits_package_from_repository_sections(diffs_root):
    parsed = diffs.parse(write_diff(diffs_root, "fake-fix", fix_diff()))
    assert (parsed.patch_id, parsed.package) == ("fake-fix", "mpfake")
    assert parsed.header["Bug"] == "https://example.invalid/fake/issues/1"
    assert parsed.description == ("Fix scale() on offloaded weights",
                                  "scale() multiplied by the wrong factor once weights were offloaded.\n\n"
                                  "Second paragraph of the explanation.")
    assert [s.path for s in parsed.package_sections()] == ["src/mpfake/core.py"]
    assert [s.path for s in parsed.other_sections()] == ["tests/test_core.py"]
    assert parsed.other_sections()[0].creates and not parsed.package_sections()[0].creates


def test_diffs_root_override_drives_diffs_for_and_patch_paths(diffs_root, monkeypatch):
    write_diff(diffs_root, "fake-fix", fix_diff())
    assert [d.path for d in diffs.diffs_for("fake-fix")] == [diffs_root / "fake-fix" / "mpfake.diff"]
    assert diffs.resolve_diff_path("upstream_diffs/fake-fix/mpfake.diff") == diffs_root / "fake-fix" / "mpfake.diff"
    assert diffs.all_diff_paths() == [diffs_root / "fake-fix" / "mpfake.diff"]
    monkeypatch.delenv("METAPATCH_DIFFS_ROOT")
    assert diffs.resolve_diff_path("upstream_diffs/x/y.diff") == ROOT / "upstream_diffs" / "x" / "y.diff"


# ---------------------------------------------------------------------------------------------
# check(): verdicts, on copies only


def test_check_applies_where_the_bug_is_present_and_leaves_the_installation_alone(fake_site, diffs_root):
    core = fake_site / "mpfake" / "core.py"
    before, cwd = sha(core), os.getcwd()
    result = diffs.check(diffs.parse(write_diff(diffs_root, "fake-fix", fix_diff())))
    assert result.verdict == diffs.APPLIES
    assert (result.distribution, result.installed) == ("mpfake", "1.2.0")
    assert [f.result for f in result.files] == ["applies"]
    assert sha(core) == before and os.getcwd() == cwd
    assert sorted(p.name for p in core.parent.iterdir()) == ["__init__.py", "core.py"]


def test_check_applies_with_an_offset_and_says_so(fake_site, diffs_root):
    set_installed(fake_site, "# a new first line upstream\n# and another\n" + BUGGY)
    result = diffs.check(diffs.parse(write_diff(diffs_root, "fake-fix", fix_diff())))
    assert result.verdict == diffs.APPLIES
    assert any("offset 2" in note for note in result.files[0].notes)


def test_check_reports_fixed_upstream_when_the_diff_applies_in_reverse(fake_site, diffs_root):
    core = set_installed(fake_site, FIXED)
    before = sha(core)
    result = diffs.check(diffs.parse(write_diff(diffs_root, "fake-fix", fix_diff())))
    assert result.verdict == diffs.FIXED_UPSTREAM
    assert sha(core) == before


def test_check_reports_drift_with_the_failing_hunk(fake_site, diffs_root):
    set_installed(fake_site, BUGGY.replace("    # keep the meta device untouched\n", "    # reworded upstream\n"))
    result = diffs.check(diffs.parse(write_diff(diffs_root, "fake-fix", fix_diff())))
    assert result.verdict == diffs.DRIFTED
    [file] = result.files
    assert file.result == "failed" and [h.number for h in file.failed_hunks] == [1]
    assert "-    factor = 2" in file.failed_hunks[0].text and "+    factor = 3" in file.failed_hunks[0].text


def test_check_tells_partly_fixed_upstream_from_drift(fake_site, diffs_root):
    # Two hunks: upstream already has the second, not the first.
    new = FIXED.replace("    total = 0\n", "    total = 0  # counted in bytes\n")
    set_installed(fake_site, FIXED)
    result = diffs.check(diffs.parse(write_diff(diffs_root, "fake-fix", dep3() + git_diff("src/mpfake/core.py", BUGGY, new))))
    assert result.verdict == diffs.DRIFTED
    [file] = result.files
    assert file.failed_hunks == [] and file.reversed_hunks == [2]
    assert "partly fixed upstream" in file.notes[0]


def test_check_missing_file_is_drift(fake_site, diffs_root):
    text = dep3() + git_diff("src/mpfake/gone.py", BUGGY, FIXED)
    result = diffs.check(diffs.parse(write_diff(diffs_root, "fake-fix", text)))
    assert result.verdict == diffs.DRIFTED and result.files[0].result == "missing"


def test_check_not_installed_and_invalid(diffs_root, fake_site):
    absent = diffs.check(diffs.parse(write_diff(diffs_root, "fake-fix", fix_diff(), package="mpfake_absent_pkg")))
    assert absent.verdict == diffs.NOT_INSTALLED and absent.installed is None
    only_tests = dep3() + git_diff("tests/test_core.py", "", "def test_x():\n    pass\n")
    invalid = diffs.check(diffs.parse(write_diff(diffs_root, "fake-tests", only_tests)))
    assert invalid.verdict == diffs.INVALID


def test_reverse_check_never_applies_forwards(tmp_path):
    # Regression: with --batch, GNU patch "assumes -R" for a reversed-looking patch unless
    # --forward is kept; a reverse check on an unfixed file must fail and change nothing.
    (tmp_path / "mpfake").mkdir()
    core = tmp_path / "mpfake" / "core.py"
    core.write_text(BUGGY)
    result = diffs._run_patch(git_diff("mpfake/core.py", BUGGY, FIXED), tmp_path, reverse=True)
    assert result.returncode != 0
    assert core.read_text() == BUGGY


def test_apply_to_copy_fixes_the_copy_only(fake_site, diffs_root, tmp_path):
    core = fake_site / "mpfake" / "core.py"
    before = sha(core)
    copy = diffs.apply_to_copy(diffs.parse(write_diff(diffs_root, "fake-fix", fix_diff())), tmp_path / "copy")
    assert (copy / "mpfake" / "core.py").read_text() == FIXED
    assert not (copy / "tests").exists()  # the repository's test section is not applied to a package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(fake_site)])}
    out = subprocess.run([sys.executable, "-c", "import mpfake.core as c; print(c.scale(1), c.__file__)"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["3", str(copy / "mpfake" / "core.py")]
    assert sha(core) == before


# ---------------------------------------------------------------------------------------------
# `metapatch diffs check`: verdicts against patch states


def fake_patch(patch_id: str = "fake-fix", affects=None, diff_paths=None) -> Patch:
    return Patch(
        id=patch_id, title="fake fix for the test", affects=affects or {"mpfake": ">=1.0"},
        # A module nobody imports: the registry's post-import hook must never fire in this process.
        targets=(Target("mpfake_never_imported.core", "scale", fingerprints=("0" * 16,),
                        wrapper=lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)),),
        upstream=Upstream(bug=("https://example.invalid/fake/issues/1",)),
        diffs=tuple(diff_paths if diff_paths is not None else (f"upstream_diffs/{patch_id}/mpfake.diff",)),
    )


@pytest.fixture
def use_registry(monkeypatch):
    def install(*patches: Patch) -> Registry:
        registry = Registry(patches)
        registry.install()
        monkeypatch.setattr(metapatch, "registry", registry)
        return registry
    return install


def run_check(capsys, *extra: str):
    code = cli_main(["diffs", "check", "--json", *extra])
    report = json.loads(capsys.readouterr().out)
    return code, report


@pytest.mark.parametrize("installed, affects, verdict, state, consistent", [
    (BUGGY, ">=1.0", "applies", "pending-import", True),
    (BUGGY, "<1.2", "applies", "not-affected", False),   # range closed but the bug is still there
    (FIXED, "<1.2", "fixed-upstream", "not-affected", True),
    (FIXED, ">=1.0", "fixed-upstream", "pending-import", False),  # fixed, yet the patch would apply
])
def test_diffs_check_compares_verdicts_with_patch_states(fake_site, diffs_root, use_registry, capsys,
                                                         installed, affects, verdict, state, consistent):
    set_installed(fake_site, installed)
    write_diff(diffs_root, "fake-fix", fix_diff())
    use_registry(fake_patch(affects={"mpfake": affects}))
    code, report = run_check(capsys)
    [row] = report["diffs"]
    assert (row["verdict"], row["patch_state"], row["consistent"]) == (verdict, state, consistent)
    assert report["consistent"] is consistent and code == (0 if consistent else 1)
    if verdict == "fixed-upstream" and not consistent:
        assert "should be not-affected" in row["message"] and "1.2.0" in row["message"]


def test_diffs_check_judges_a_disabled_patch_by_its_range(fake_site, diffs_root, use_registry, capsys, monkeypatch):
    # Disabling a patch does not fix the bug: a fixed-upstream diff still disagrees with an open range.
    set_installed(fake_site, FIXED)
    write_diff(diffs_root, "fake-fix", fix_diff())
    monkeypatch.setenv("METAPATCH_DISABLE", "fake-fix")
    use_registry(fake_patch())
    code, report = run_check(capsys)
    [row] = report["diffs"]
    assert (row["patch_state"], row["verdict"], row["consistent"], code) == ("disabled", "fixed-upstream", False, 1)


def test_diffs_check_requires_a_complete_dep3_header(fake_site, diffs_root, use_registry, capsys):
    text = fix_diff().replace("Bug: https://example.invalid/fake/issues/1\n", "").replace("Applied-Upstream: no\n", "")
    write_diff(diffs_root, "fake-fix", text)
    use_registry(fake_patch())
    code, report = run_check(capsys)
    [row] = report["diffs"]
    assert row["consistent"] and row["header_missing"] == ["Bug", "Applied-Upstream"]
    assert (report["ok"], code) == (False, 1)
    assert cli_main(["diffs", "check"]) == 1
    assert "DEP-3 header lacks: Bug, Applied-Upstream" in capsys.readouterr().out


def test_diffs_check_without_the_diffs_folder_says_where_to_point(tmp_path, monkeypatch, use_registry, capsys):
    monkeypatch.setenv("METAPATCH_DIFFS_ROOT", str(tmp_path / "absent"))
    use_registry(fake_patch())
    assert cli_main(["diffs", "check"]) == 2
    assert "METAPATCH_DIFFS_ROOT" in capsys.readouterr().out
    use_registry(fake_patch(diff_paths=()))
    assert cli_main(["diffs", "check"]) == 0


def test_diffs_check_drift_against_an_in_range_patch_disagrees_and_shows_hunks(fake_site, diffs_root,
                                                                                use_registry, capsys):
    set_installed(fake_site, BUGGY.replace("    factor = 2\n", "    factor = 2.0\n"))
    write_diff(diffs_root, "fake-fix", fix_diff())
    use_registry(fake_patch())
    assert cli_main(["diffs", "check"]) == 1
    text = capsys.readouterr().out
    assert "drifted (DISAGREES)" in text and "failing hunk #1" in text and "-    factor = 2" in text


def test_diffs_check_flags_missing_and_orphan_diffs(fake_site, diffs_root, use_registry, capsys):
    write_diff(diffs_root, "nobody-owns-this", fix_diff())
    use_registry(fake_patch())  # lists upstream_diffs/fake-fix/mpfake.diff, which is not written
    code, report = run_check(capsys)
    verdicts = {(r["patch_id"], r["verdict"]) for r in report["diffs"]}
    assert verdicts == {("fake-fix", "missing"), ("nobody-owns-this", "orphan")}
    assert code == 1 and not any(r["consistent"] for r in report["diffs"])


def test_diffs_check_with_no_diffs_and_unknown_ids(diffs_root, use_registry, capsys):
    use_registry(fake_patch(diff_paths=()))
    assert run_check(capsys) == (0, {"ok": True, "consistent": True, "diffs": []})
    assert cli_main(["diffs", "check", "no-such-patch"]) == 2
    assert "unknown patch id" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The real upstream_diffs/ folder, whatever it holds


def _metapatch_json(*args: str) -> "tuple[int, object]":
    env = {k: v for k, v in os.environ.items() if k not in ("METAPATCH_DIFFS_ROOT", "METAPATCH_DISABLE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-m", "metapatch", *args, "--json"], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_real_upstream_diffs_agree_with_metapatch_status():
    code, report = _metapatch_json("diffs", "check", "--import-targets")
    _, status = _metapatch_json("status", "--import-targets")
    states = {row["id"]: row for row in status}
    on_disk = {f"upstream_diffs/{p.parent.name}/{p.name}" for p in (ROOT / "upstream_diffs").glob("*/*.diff")}
    listed = {rel for row in status for rel in row["diffs"]}
    assert {row["diff"] for row in report["diffs"]} == on_disk | listed
    problems = []
    for row in report["diffs"]:
        status_row = states.get(row["patch_id"])
        where = f"{row['diff']} ({row['verdict']}): {row['message']}"
        if status_row is None or row["diff"] not in status_row["diffs"]:
            problems.append(f"{where}: no patch lists it")
            continue
        state, reason = status_row["state"], status_row["reason"]
        assert row["patch_state"] == state, where
        if row["verdict"] == "fixed-upstream" and state != "not-affected":
            problems.append(f"{where}: fixed upstream but the patch is {state}")
        elif row["verdict"] == "applies" and f"{row['distribution']} {row['installed']} is outside" in reason:
            problems.append(f"{where}: the bug is present but the patch's range excludes {row['installed']}")
        elif row["verdict"] == "drifted" and state not in ("stale", "not-affected") and not row["consistent"]:
            # (consistent: a release older than the diff's Upstream-Base, where the code around the fix differs)
            problems.append(f"{where}: the diff does not apply where the patch is {state}")
        elif row["verdict"] in ("missing", "orphan", "invalid"):
            problems.append(where)
        if row.get("header_missing"):
            problems.append(f"{row['diff']}: DEP-3 header lacks {', '.join(row['header_missing'])}")
    assert not problems, "\n".join(problems)
    assert report["ok"] is True and code == 0


# ---------------------------------------------------------------------------------------------
# A series of diffs for one package: <package>-1-<what>.diff, <package>-2-<what>.diff, ... (one
# pull request each, diff N written on top of 1..N-1)

SECOND = FIXED.replace('    return "unchanged"\n', '    return "changed by the second diff"\n')
THIRD = SECOND.replace('    return "changed by the second diff"\n', '    return "changed twice"\n')


def write_series(root: Path, patch_id: str, *steps: str, names=("scale", "tail", "tail-again")) -> list:
    """Diff N takes the source from steps[N-1] to steps[N]; returns the paths, in order."""
    paths = []
    for n, (old, new) in enumerate(zip(steps, steps[1:]), 1):
        paths.append(write_diff(root, patch_id, dep3() + git_diff("src/mpfake/core.py", old, new),
                                package=f"mpfake-{n}-{names[n - 1]}"))
    return paths


def test_series_names_parse_to_package_and_position(diffs_root):
    assert diffs.name_parts("upstream_diffs/x/peft-2-keep-placement.diff") == ("peft", 2)
    assert diffs.name_parts("upstream_diffs/x/bitsandbytes.diff") == ("bitsandbytes", None)
    assert diffs.name_parts("upstream_diffs/x/peft-10.diff") == ("peft", 10)
    paths = [write_diff(diffs_root, "fake-fix", fix_diff(), package=f"mpfake-{n}-step") for n in (10, 2, 1)]
    found = diffs.diffs_for("fake-fix")
    assert [d.series_index for d in found] == [1, 2, 10]  # numeric order, not the file names' order
    assert {d.package for d in found} == {"mpfake"} and sorted(d.path for d in found) == sorted(paths)
    assert diffs.series_problem(found) is not None  # 1, 2, 10: a gap
    assert diffs.series_problem(found[:2]) is None


def test_series_applies_cumulatively_and_each_diff_is_checked_on_top_of_the_ones_before(fake_site, diffs_root,
                                                                                        tmp_path):
    write_series(diffs_root, "fake-fix", BUGGY, FIXED, SECOND, THIRD)
    series = diffs.diffs_for("fake-fix")
    copy = diffs.apply_to_copy(series, tmp_path / "copy")
    assert (copy / "mpfake" / "core.py").read_text() == THIRD
    assert [c.verdict for c in diffs.check_series(series)] == [diffs.APPLIES] * 3
    assert "on top of diffs 1..2 of its series" in diffs.check_series(series)[2].detail
    # Diff 3 alone does not apply to the installed source: it is written on top of diff 2.
    assert diffs.check(series[2]).verdict == diffs.DRIFTED
    # Upstream merged the first two: the third still applies, the first two are fixed upstream.
    set_installed(fake_site, SECOND)
    assert [c.verdict for c in diffs.check_series(series)] == [diffs.FIXED_UPSTREAM, diffs.FIXED_UPSTREAM,
                                                                diffs.APPLIES]
    assert "diff 1 of the series is already in this file" in diffs.check_series(series)[2].files[0].notes[0]


def test_apply_to_copy_names_the_diff_of_a_series_that_does_not_apply(fake_site, diffs_root, tmp_path):
    first, second = write_series(diffs_root, "fake-fix", BUGGY, FIXED, SECOND)
    second.write_text(second.read_text().replace('-    return "unchanged"', '-    return "something else"'))
    with pytest.raises(RuntimeError, match=r"mpfake-2-tail.diff does not apply .*on top of the 1 diff"):
        diffs.apply_to_copy(diffs.diffs_for("fake-fix"), tmp_path / "copy")


def test_diffs_check_reports_each_diff_of_a_series(fake_site, diffs_root, use_registry, capsys):
    paths = write_series(diffs_root, "fake-fix", BUGGY, FIXED, SECOND)
    use_registry(fake_patch(diff_paths=[f"upstream_diffs/fake-fix/{p.name}" for p in paths]))
    code, report = run_check(capsys)
    rows = report["diffs"]
    assert [(r["series_index"], r["series_size"], r["verdict"], r["consistent"]) for r in rows] == \
        [(1, 2, "applies", True), (2, 2, "applies", True)]
    assert code == 0 and all(r["package"] == "mpfake" for r in rows)
    assert cli_main(["diffs", "check"]) == 0
    assert "mpfake-2-tail.diff [mpfake 1.2.0] (diff 2 of 2, on top of 1): applies (ok)" in capsys.readouterr().out
    # A series numbered 1, 3 is refused by name.
    paths[1].rename(paths[1].with_name("mpfake-3-tail.diff"))
    use_registry(fake_patch(diff_paths=["upstream_diffs/fake-fix/mpfake-1-scale.diff",
                                        "upstream_diffs/fake-fix/mpfake-3-tail.diff"]))
    code, report = run_check(capsys)
    assert code == 1 and {r["verdict"] for r in report["diffs"]} == {"invalid"}
    assert "not a series numbered 1..2" in report["diffs"][0]["message"]


# ---------------------------------------------------------------------------------------------
# `metapatch diffs check --run`: behaviour, on the synthetic package with a real scenario run
# (the shipped harness, a fresh interpreter per run, the diff applied to a copy)

SCENARIO_MODULE = """\
def scale_is_fixed(workdir):
    from mpfake.core import scale
    assert scale(1) == 3, f"scale(1) is {scale(1)}"
"""


@pytest.fixture
def fake_scenario(fake_site, monkeypatch):
    from metapatch.selftest import Scenario
    from metapatch.survey import probe

    (fake_site / "mpfake_scenarios.py").write_text(SCENARIO_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake_site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("METAPATCH_SELFTEST_FORK", "0")  # the warm parent would not see the fake site
    scenario = Scenario("fake-fix", "scale", "mpfake_scenarios:scale_is_fixed")
    monkeypatch.setattr(probe, "scenarios_of", lambda patch: [scenario] if patch.id == "fake-fix" else [])
    return fake_site


def test_diffs_check_run_passes_when_the_applied_diff_fixes_the_scenario(fake_scenario, diffs_root,
                                                                          use_registry, capsys):
    write_diff(diffs_root, "fake-fix", fix_diff())
    use_registry(fake_patch())
    before = sha(fake_scenario / "mpfake" / "core.py")
    code, report = run_check(capsys, "--run", "--timeout", "120")
    [run] = report["runs"]
    row = run["scenarios"]["fake-fix/scale"]
    assert row["without_diff"]["result"] == "fail" and "scale(1) is 2" in row["without_diff"]["error"]
    assert row["with_diff"]["result"] == "pass"
    assert (run["result"], code, report["ok"]) == ("pass", 0, True)
    assert sha(fake_scenario / "mpfake" / "core.py") == before  # the installed package is never touched


def test_diffs_check_run_fails_when_the_diff_applies_but_does_not_fix(fake_scenario, diffs_root,
                                                                       use_registry, capsys):
    wrong = BUGGY.replace("    factor = 2\n", "    factor = 4\n")
    write_diff(diffs_root, "fake-fix", fix_diff(new=wrong))
    use_registry(fake_patch())
    code, report = run_check(capsys, "--run", "--timeout", "120")
    [run] = report["runs"]
    assert report["diffs"][0]["verdict"] == "applies" and report["consistent"]
    assert run["result"] == "fail" and "1 of 1 scenario(s) fail" in run["reason"]
    assert (code, report["ok"]) == (1, False)
    assert cli_main(["diffs", "check", "--run", "--timeout", "120"]) == 1
    assert "with it FAILS AssertionError: scale(1) is 4" in capsys.readouterr().out


def test_diffs_check_run_does_not_run_a_drifted_diff(fake_scenario, diffs_root, use_registry, capsys):
    set_installed(fake_scenario, BUGGY.replace("    factor = 2\n", "    factor = 2.0\n"))
    write_diff(diffs_root, "fake-fix", fix_diff())
    use_registry(fake_patch())
    code, report = run_check(capsys, "--run")
    [run] = report["runs"]
    assert run["result"] == "not-run" and "drifted" in run["reason"] and run["scenarios"] == {}
    assert code == 1  # the drift itself disagrees with the in-range patch


def test_upstream_base_is_read_as_a_release_however_it_is_written():
    from metapatch.commands.diffs import _older_than

    assert _older_than("5.11.0", "5.25.0") and _older_than("5.11.0", "transformers 5.25.0")
    assert not _older_than("5.25.0", "transformers 5.25.0") and not _older_than("5.26.0", "5.25.0")
    assert not _older_than("5.11.0", "main 95f9af309d4d5793847169c39288dcd3fcbdf564 (2026-08-19)")
    assert not _older_than("5.11.0", None) and not _older_than(None, "5.25.0")
