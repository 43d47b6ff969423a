"""metapatch survey: the static fingerprint reader agrees with the runtime check, and every Patch
record agrees with its committed survey table (metapatch/survey/tables/<id>.json).

No network: the tables are committed; refresh them with ``metapatch survey --all --static`` (and
``metapatch survey ID --run`` for the measured columns).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import metapatch
from metapatch._framework.registry import fingerprint, resolve
from metapatch.survey import check, static, table, variants

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# The static reader locates what inspect.getsource returns


SYNTHETIC = '''
import functools

def plain(x):
    """doc"""
    return x + 1

def deco(f):
    return f

class Outer:
    class Inner:
        @staticmethod
        @deco
        def method(x):
            return x * 2

    if True:
        def conditional(self):
            return 1
    else:
        def conditional(self):
            return 2

    @property
    def prop(self):
        return 3

try:
    def guarded(y):
        return y - 1
except ImportError:
    pass
'''


@pytest.mark.parametrize("qualname", ["plain", "Outer", "Outer.Inner", "Outer.Inner.method", "Outer.prop",
                                      "guarded"])
def test_static_segment_hashes_like_inspect(tmp_path, monkeypatch, qualname):
    (tmp_path / "mp_survey_synthetic.py").write_text(SYNTHETIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("mp_survey_synthetic")
    _, _, obj = resolve(module, qualname)
    assert static.fingerprint_in_source(SYNTHETIC, qualname) == fingerprint(obj)


def test_static_reader_reports_absent_objects_and_modules():
    assert static.fingerprint_in_source(SYNTHETIC, "Outer.missing") == static.ABSENT
    assert static.fingerprint_in_source(None, "plain") == static.MODULE_ABSENT
    # the later of two definitions wins, as when the module runs; they differ, so this can fail
    assert static.locate(SYNTHETIC, "Outer.conditional").strip().endswith("return 2")


def test_variants_group_consecutive_releases_and_give_exact_ranges():
    releases = ["1.0.0", "1.1.0", "1.2.0", "1.3.0"]
    prints = {"1.0.0": {"t": "a"}, "1.1.0": {"t": "a"}, "1.2.0": {"t": "b"}, "1.3.0": {"t": "a"}}
    rows = variants.group(releases, prints)
    assert [(r["variant"], r["releases"], r["range"]) for r in rows] == [
        ("V1", ["1.0.0", "1.1.0"], ">=1.0.0,<1.2.0"), ("V2", ["1.2.0"], ">=1.2.0,<1.3.0"), ("V1", ["1.3.0"], ">=1.3.0")]


# ---------------------------------------------------------------------------------------------
# (a) static == runtime for every Target of every patch, on the installed stacks

PROBE = textwrap.dedent('''
    import importlib, json, os
    os.environ["METAPATCH_DISABLE"] = "all"
    import metapatch
    from metapatch._framework.registry import fingerprint, resolve
    from metapatch.survey.static import installed_fingerprints
    out = {}
    for patch in metapatch.registry.patches.values():
        found = installed_fingerprints([t.dotted for t in patch.targets])
        for t in patch.targets:
            try:
                runtime = fingerprint(resolve(importlib.import_module(t.module), t.qualname)[2])
            except ModuleNotFoundError as exc:
                runtime = "not-installed: " + str(exc)
            except Exception as exc:
                runtime = "error: %s: %s" % (type(exc).__name__, exc)
            out[t.dotted] = [runtime, found[t.dotted]]
    print(json.dumps(out))
''')


def test_static_fingerprints_equal_runtime_ones():
    # The installed stack of the interpreter running the suite: every matrix environment checks its own.
    pytest.importorskip("transformers", reason="needs the Hugging Face stack installed")
    venv = sys.executable
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAPATCH_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=str(REPO), capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = json.loads(proc.stdout.strip().splitlines()[-1])
    measured = {k: v for k, v in pairs.items() if not v[0].startswith("not-installed")}
    assert len(measured) >= 15, f"too few targets importable in {venv}: {sorted(measured)}"
    wrong = {k: v for k, v in measured.items() if v[0] != v[1]}
    assert not wrong, f"static reader != runtime fingerprint in {venv} ([runtime, static]): {wrong}"


# ---------------------------------------------------------------------------------------------
# (b) every Patch record agrees with its survey table

PATCH_IDS = sorted(metapatch.registry.patches)


@pytest.mark.parametrize("patch_id", PATCH_IDS)
def test_patch_record_agrees_with_its_survey_table(patch_id):
    patch = metapatch.registry.patches[patch_id]
    surveyed = table.read(patch_id)
    assert surveyed is not None, (
        f"{patch_id} has no survey table: run `metapatch survey {patch_id}` (static) or "
        f"`metapatch survey {patch_id} --run`, and commit metapatch/survey/tables/{patch_id}.json")
    found = check.problems(patch, surveyed)
    assert not found, "the Patch record disagrees with its survey table:\n" + "\n".join(found)


def test_check_catches_a_record_that_disagrees():
    """The check is not vacuous: a record whose range and fingerprints are wrong for a table fails."""
    target = metapatch.Target("pkg.mod", "f", ("aaaa", "dead"), wrapper=lambda *a: None)
    patch = metapatch.Patch("synthetic", "t", {"pkg": ">=2.0"}, (target,))
    rows = variants.group(["1.0", "2.0", "3.0"], {"1.0": {"pkg.mod:f": "aaaa"}, "2.0": {"pkg.mod:f": "aaaa"},
                                                  "3.0": {"pkg.mod:f": "bbbb"}})
    measured = {"pins": {"pkg": "1.0"}, "bug": "yes", "error": "KeyError", "patched": "pass", "diff": "pass"}
    rows[0]["runs"] = [measured]
    synthetic = {"patch": "synthetic", "distributions": {"pkg": {
        "window": ">=1.0", "targets": ["pkg.mod:f"], "releases": ["1.0", "2.0", "3.0"], "rows": rows}}}
    found = "\n".join(check.problems(patch, synthetic))
    assert "dead is in the record but in no pkg release" in found
    assert "1.0 lie outside affects" in found  # measured affected, outside the range
    assert "fingerprint bbbb" in found and "goes stale" in found  # 3.0 inside affects, code not accepted


def test_a_read_only_distribution_is_checked_on_every_release_and_never_run(monkeypatch):
    """torch's releases are read, not installed: a target there must accept every release's code whatever the
    patch's ranges (a patch that applies on any torch goes stale on one it does not accept), and --run skips it."""
    from metapatch.survey import plan

    target = metapatch.Target("torch.mod", "f", ("aaaa",), wrapper=lambda *a: None)
    patch = metapatch.Patch("synthetic", "t", {"accelerate": ">=1.0"}, (target,))
    rows = variants.group(["2.5", "2.6"], {"2.5": {"torch.mod:f": "aaaa"}, "2.6": {"torch.mod:f": "bbbb"}})
    section = {"window": ">=2.5", "read_only": True, "targets": ["torch.mod:f"], "releases": ["2.5", "2.6"],
               "rows": rows}
    found = "\n".join(check.problems(patch, {"patch": "synthetic", "distributions": {"torch": section}}))
    assert "torch 2.6 has fingerprint bbbb, not in the record" in found and "2.5" not in found

    measured = []
    monkeypatch.setattr(plan, "run_row", lambda *a, **k: measured.append(a) or [])
    plan.run_table({"distributions": {"torch": section}}, patch, 1, 1.0, [], log=lambda line: None)
    assert measured == [] and section["rows"] == rows


def test_survey_venvs_pin_the_running_torch_where_the_base_interpreter_has_none(tmp_path, monkeypatch):
    """Without torch in the base interpreter pip would pick torch itself (the newest, a CUDA build: 2.14.1 on a
    machine capped there, while the suite runs 2.13.0); the venvs pin the running interpreter's release instead."""
    import importlib.metadata

    from metapatch.survey import runner

    def interpreter(has_torch: bool) -> str:
        path = tmp_path / f"python-{has_torch}"
        path.write_text(f"#!/bin/sh\nexit {0 if has_torch else 1}\n")
        path.chmod(0o755)
        return str(path)

    running = importlib.metadata.version("torch").split("+")[0]
    for has_torch, expected in ((False, {"torch": running}), (True, {})):
        runner.torch_pin.cache_clear()
        monkeypatch.setattr(runner, "base_python", lambda: interpreter(has_torch))
        assert runner.torch_pin() == expected
    runner.torch_pin.cache_clear()


def test_a_remote_wheel_is_read_by_range_requests(tmp_path):
    """The survey reads a module out of a torch wheel without downloading it: only the central directory and
    the member's bytes travel (a local server that honours Range and counts the bytes it sends)."""
    import http.server
    import threading
    import zipfile

    from metapatch.survey import releases

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/mod.py", "def f():\n    return 1\n")
        zf.writestr("pkg/big.bin", os.urandom(3 << 20), compress_type=zipfile.ZIP_STORED)
    data, sent = wheel.read_bytes(), []

    class Ranges(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()

        def do_GET(self):
            start, end = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
            body = data[start:end + 1]
            sent.append(len(body))
            self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ranges)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = releases.RemoteWheel(f"http://127.0.0.1:{server.server_port}/{wheel.name}", wheel.name)
        assert static.read_module_from_archive(remote, "pkg.mod") == "def f():\n    return 1\n"
        assert static.fingerprints(lambda m: static.read_module_from_archive(remote, m), ["pkg.mod:f"]) == \
            static.fingerprints(lambda m: static.read_module_from_archive(wheel, m), ["pkg.mod:f"])
    finally:
        server.shutdown()
    assert sum(sent) < len(data) / 4, (sum(sent), len(data))  # not the 3 MiB member


def _run(bug: str) -> dict:
    return {"pins": {}, "bug": bug, "error": "E" if bug == "yes" else "", "patched": "pass", "diff": "no diff",
            "fixed": ["s"] if bug == "yes" else []}


def test_run_row_bisects_a_fix_outside_the_fingerprinted_code():
    """One code variant, but the bug is gone from 1.4 on (fixed elsewhere): the row splits there."""
    from metapatch.survey import plan

    releases = ["1.0", "1.1", "1.2", "1.3", "1.4", "1.5"]
    row = variants.group(releases, {v: {"t": "same"} for v in releases})[0]
    measured = []

    def measure(version):
        measured.append(version)
        return [_run("yes" if version < "1.4" else "no")]

    rows = plan.run_row(row, releases, measure)
    assert [(r["releases"], r["range"], table.row_status(r)) for r in rows] == [
        (["1.0", "1.1", "1.2", "1.3"], ">=1.0,<1.4", table.AFFECTED), (["1.4", "1.5"], ">=1.4", table.NOT_AFFECTED)]
    assert len(measured) <= 5 and {"1.0", "1.5"} <= set(measured)
    # a --static refresh keeps the split measured rows instead of the one static row
    static_table = {"distributions": {"pkg": {"releases": releases, "rows": [dict(row)]}}}
    plan.carry_runs(static_table, {"distributions": {"pkg": {"rows": rows}}})
    assert [r["releases"] for r in static_table["distributions"]["pkg"]["rows"]] == [releases[:4], releases[4:]]
    # a row that grew (more releases read with the same code) keeps the runs of the releases measured before
    grown = releases + ["1.6"]
    static_table = {"distributions": {"pkg": {"releases": grown, "rows": variants.group(grown, {v: {"t": "same"} for v in grown})}}}
    plan.carry_runs(static_table, {"distributions": {"pkg": {"rows": [{**rows[0], "runs": [_run("yes")]}]}}})
    [kept] = static_table["distributions"]["pkg"]["rows"]
    assert kept["releases"] == grown and table.row_status(kept) == table.AFFECTED


def test_run_row_splits_off_releases_where_the_scenario_cannot_run():
    """n/a at the oldest release (a combination that cannot load the model at all), the bug at the
    newest: the n/a release gets a row of its own instead of joining the affected range."""
    from metapatch.survey import plan

    releases = ["0.46.0", "0.46.1"]
    row = variants.group(releases, {v: {"t": "same"} for v in releases})[0]

    def measure(version):
        return [_run("yes")] if version == "0.46.1" else [dict(_run("no"), bug="n-a", patched="", fixed=[])]

    rows = plan.run_row(row, releases, measure)
    assert [(r["releases"], table.row_status(r)) for r in rows] == [
        (["0.46.0"], table.UNDECIDED), (["0.46.1"], table.AFFECTED)]


def test_run_row_with_ends_newest_measures_one_release_per_variant():
    from metapatch.survey import plan

    releases = ["1.0", "1.1", "1.2"]
    row = variants.group(releases, {v: {"t": "same"} for v in releases})[0]
    measured = []
    rows = plan.run_row(row, releases, lambda v: measured.append(v) or [_run("yes")], ends="newest")
    assert measured == ["1.2"]
    assert [(r["releases"], table.row_status(r)) for r in rows] == [(releases, table.AFFECTED)]


def test_static_reader_follows_a_name_the_module_imports(tmp_path, monkeypatch):
    """``getattr(module, name)`` finds an imported function; the static reader must hash the same one."""
    pkg = tmp_path / "mp_survey_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "impl.py").write_text("def helper(x):\n    return x * 3\n")
    (pkg / "api.py").write_text("try:\n    from .sub.impl import helper as exported\nexcept ImportError:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    api = importlib.import_module("mp_survey_pkg.api")
    found = static.fingerprints(lambda m: static.read_module_from_site(tmp_path, m), ["mp_survey_pkg.api:exported"])
    assert found == {"mp_survey_pkg.api:exported": fingerprint(resolve(api, "exported")[2])}


def test_result_cache_key_covers_the_shared_helpers_a_patch_imports():
    """A cached survey result is reused only while the code that produced it is unchanged, and a
    patch's behaviour lives partly in the shared helpers it imports."""
    from metapatch.survey import runner

    package = Path(runner.__file__).resolve().parents[1]
    tied = runner._shared_helpers([package / "patches" / "tied_device_map_transformers.py"])
    peft = runner._shared_helpers(sorted((package / "patches" / "peft_offload_redispatch").glob("*.py")))
    assert package / "_offload" / "tied_placement.py" in tied
    assert package / "_offload" / "adapter_offload.py" in peft
    assert package / "_offload" / "offloaded_weights.py" not in tied


def test_companions_are_pinned_inside_the_patchs_affected_range(monkeypatch):
    """accelerate-dispatch-skip-keys needs transformers 5.5-5.22: its accelerate releases are measured
    with transformers from that range, never with the newest (fixed) or oldest (unaffected) one."""
    from metapatch.survey import plan
    from metapatch.survey import releases as rel

    window = {"transformers": ["4.57.1", "5.4.0", "5.6.0", "5.22.2", "5.23.0", "5.24.0"],
              "accelerate": ["1.10.0", "1.15.0"], "peft": ["0.17.0", "0.21.2"], "bitsandbytes": ["0.46.0", "0.50.2"]}
    monkeypatch.setattr(rel, "releases_in_window", lambda dist, *a, **k: window[dist])
    patch = metapatch.registry.patches["accelerate-dispatch-skip-keys"]
    pins = plan.combinations(patch, "accelerate", "1.12.0", 2)
    assert [p["transformers"] for p in pins] == ["5.22.2", "5.6.0"]
    assert all(p["accelerate"] == "1.12.0" for p in pins)


def test_an_uninstallable_companion_steps_back_to_the_newest_that_installs(monkeypatch):
    """transformers 5.25.0 needs kernels 0.19.1, which PyPI's index may lack: an accelerate release is then
    measured with the newest transformers that installs (the row names what was asked for), not left
    undecided. Where nothing older installs, the result stays uninstallable."""
    from metapatch.survey import plan, runner
    from metapatch.survey import releases as rel

    window = {"transformers": ["5.23.0", "5.24.0", "5.25.0"], "accelerate": ["1.15.0", "1.16.0"],
              "peft": ["0.21.2"], "bitsandbytes": ["0.50.2"]}
    monkeypatch.setattr(rel, "releases_in_window", lambda dist, *a, **k: window[dist])
    asked = []

    def run_combination(patch_id, pins, timeout, log=None):
        asked.append(dict(pins))
        if pins.get("transformers") == "5.25.0":
            return {"pins": dict(pins), "status": "uninstallable", "reason": "no kernels 0.19.1", "patch_source": "x"}
        return {"pins": dict(pins), "status": "measured", "patch_source": "x",
                "scenarios": {"s": {"unpatched": {"result": "fail", "error_type": "ValueError"},
                                    "patched": {"result": "pass"}, "diff": {"result": "pass"}}}}

    monkeypatch.setattr(runner, "run_combination", run_combination)
    patch = metapatch.registry.patches["accelerate-tie-before-load"]
    result = plan._run_installable(patch, "accelerate", {"accelerate": "1.16.0", "transformers": "5.25.0"}, 60, print)
    assert [a["transformers"] for a in asked] == ["5.25.0", "5.24.0"]
    assert result["status"] == "measured" and result["pins"]["transformers"] == "5.24.0"
    assert result["stepped_back_from"]["transformers"] == "5.25.0"
    window["transformers"] = ["5.25.0"]
    asked.clear()
    stuck = plan._run_installable(patch, "accelerate", {"accelerate": "1.16.0", "transformers": "5.25.0"}, 60, print)
    assert stuck["status"] == "uninstallable" and len(asked) == 1
