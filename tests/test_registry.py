"""The patch framework on small synthetic targets: every import ordering, gating, staleness,
failures, disabling, threads, reloads and unpatch identity.

Each test writes a fake library (``fakelib``, with installed-distribution metadata) and a package
of patch records for it (``fakepatches``), then runs a script in a fresh interpreter so import
order is real. The script prints one JSON object as its last line.
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

REPO = Path(__file__).resolve().parents[1]

FAKELIB_CORE = '''
def compute(x):
    return x * 10


class Thing:
    def method(self, x):
        return x + 1

    @staticmethod
    def helper(x):
        return x - 1
'''

PATCHES = {
    # Wraps a function and re-export site; adds 1 so a double wrap would show as +2.
    "p_compute": '''
from metapatch import Patch, Target, Upstream
from fakepatches import FP

def _plus_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1

PATCH = Patch(
    id="fake-compute", title="compute is off by one",
    affects={"fakelib": AFFECTS},
    targets=(Target("fakelib.core", "compute", FP["fakelib.core:compute"], wrapper=_plus_one,
                    aliases=("fakelib:compute",)),),
    upstream=Upstream(bug=("https://example.invalid/fakelib/issues/1",), fixed_in={"fakelib": "2.0"}),
)
''',
    # Plain replacement of a method and a staticmethod (the hot-path style).
    "p_thing": '''
from metapatch import Patch, Target
from fakepatches import FP

def _method(original):
    def method(self, x):
        return original(self, x) * 100
    return method

def _helper(original):
    return staticmethod(lambda x: original.__func__(x) * 1000)

PATCH = Patch(
    id="fake-thing", title="Thing needs scaling",
    affects={"fakelib": ">=1.0"},
    targets=(Target("fakelib.core", "Thing.method", FP["fakelib.core:Thing.method"], replacement=_method),
             Target("fakelib.core", "Thing.helper", FP["fakelib.core:Thing.helper"], replacement=_helper)),
)
''',
}


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def world(tmp_path):
    """A fake installed library plus fake patches; returns a runner for scripts."""

    def build(version="1.2.0", affects=">=1.0,<2.0", core=FAKELIB_CORE, patches=None, fingerprints=None):
        _write(tmp_path, "fakelib/__init__.py", "from .core import compute\n")
        _write(tmp_path, "fakelib/core.py", core)
        _write(tmp_path, "consumer.py", "from fakelib.core import compute\n")
        _write(tmp_path, f"fakelib-{version}.dist-info/METADATA",
               f"Metadata-Version: 2.1\nName: fakelib\nVersion: {version}\n")
        if fingerprints is None:
            out = subprocess.run([sys.executable, "-m", "metapatch", "fingerprint", "fakelib.core:compute",
                                  "fakelib.core:Thing.method", "fakelib.core:Thing.helper"],
                                 env=_env(tmp_path), capture_output=True, text=True, check=True).stdout
            fingerprints = dict(line.split() for line in out.splitlines())
        _write(tmp_path, "fakepatches/__init__.py", f"FP = {fingerprints!r}\n")
        for name, text in (patches or PATCHES).items():
            _write(tmp_path, f"fakepatches/{name}.py", text.replace("AFFECTS", repr(affects)))
        return run

    def run(script: str, env=None):
        prelude = textwrap.dedent('''
            import json, sys, warnings, logging
            warnings.simplefilter("always")
            from metapatch._framework.registry import Registry, load_patches, MARKER
            from metapatch import MetapatchWarning, MetapatchError
            def states(reg):
                return {r["id"]: r["state"] for r in reg.status()}
            def rows(reg):
                return {r["id"]: r for r in reg.status()}
        ''')
        proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], env=_env(tmp_path, env),
                              capture_output=True, text=True, cwd=tmp_path)
        if proc.returncode != 0:
            raise AssertionError(f"script failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return build


def _env(root: Path, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO)])
    env.update(extra or {})
    return env


def test_metapatch_first_then_target(world):
    out = world()('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        before = states(reg)
        import fakelib.core, fakelib
        print(json.dumps({"before": before, "after": states(reg), "compute": fakelib.core.compute(2),
                          "reexport": fakelib.compute(2), "method": fakelib.core.Thing().method(1),
                          "helper": fakelib.core.Thing.helper(3)}))
    ''')
    assert out["before"] == {"fake-compute": "pending-import", "fake-thing": "pending-import"}
    assert out["after"] == {"fake-compute": "applied", "fake-thing": "applied"}
    assert (out["compute"], out["reexport"], out["method"], out["helper"]) == (21, 21, 200, 2000)


def test_target_first_then_metapatch_covers_declared_reexport(world):
    out = world()('''
        import fakelib, fakelib.core
        original = fakelib.core.compute
        reg = Registry(load_patches("fakepatches")); reg.install()
        print(json.dumps({"states": states(reg), "compute": fakelib.core.compute(2), "reexport": fakelib.compute(2),
                          "same_wrapper": fakelib.compute is fakelib.core.compute,
                          "wraps_original": fakelib.core.compute.__wrapped__ is original}))
    ''')
    assert out["states"] == {"fake-compute": "applied", "fake-thing": "applied"}
    assert out["compute"] == out["reexport"] == 21
    assert out["same_wrapper"] and out["wraps_original"]


def test_capture_by_name_before_metapatch_is_reported(world):
    out = world()('''
        import consumer
        reg = Registry(load_patches("fakepatches")); reg.install()
        print(json.dumps({"notes": rows(reg)["fake-compute"]["notes"], "consumer": consumer.compute(2)}))
    ''')
    assert out["consumer"] == 20  # not rewritten behind the user's back ...
    assert any("consumer" in note and "bypass" in note for note in out["notes"])  # ... but said


def test_target_never_imported_is_pending(world):
    out = world()('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        r = rows(reg)["fake-compute"]
        print(json.dumps({"state": r["state"], "reason": r["reason"], "imported": "fakelib.core" in sys.modules,
                          "installed": r["installed"], "affects": r["affects"], "upstream": r["upstream"],
                          "fixed_in": r["fixed_in"]}))
    ''')
    assert out["state"] == "pending-import" and "fakelib.core" in out["reason"]
    assert out["imported"] is False
    assert out["installed"] == {"fakelib": "1.2.0"} and out["affects"] == {"fakelib": ">=1.0,<2.0"}
    assert out["upstream"].startswith("https://") and out["fixed_in"] == {"fakelib": "2.0"}


def test_unpatch_restores_exact_objects_everywhere_then_reimport(world):
    out = world()('''
        import fakelib, fakelib.core
        orig = (fakelib.core.compute, fakelib.core.Thing.__dict__["method"], fakelib.core.Thing.__dict__["helper"])
        reg = Registry(load_patches("fakepatches")); reg.install()
        import consumer  # captures the wrapper by name after patching
        patched = consumer.compute(2)
        reg.unpatch()
        now = (fakelib.core.compute, fakelib.core.Thing.__dict__["method"], fakelib.core.Thing.__dict__["helper"])
        identical = [a is b for a, b in zip(orig, now)] + [fakelib.compute is orig[0], consumer.compute is orig[0]]
        after_unpatch = states(reg)
        for name in [m for m in sys.modules if m == "fakelib" or m.startswith("fakelib.")]:
            del sys.modules[name]
        import fakelib.core as fresh
        reimported = fresh.compute(2)
        reg.install()
        print(json.dumps({"patched": patched, "identical": identical, "after_unpatch": after_unpatch,
                          "reimported": reimported, "reinstalled": states(reg), "again": fresh.compute(2)}))
    ''')
    assert out["patched"] == 21
    assert all(out["identical"]), out["identical"]
    assert out["after_unpatch"] == {"fake-compute": "disabled", "fake-thing": "disabled"}
    assert out["reimported"] == 20  # unpatch holds until install() is called again
    assert out["reinstalled"] == {"fake-compute": "applied", "fake-thing": "applied"}
    assert out["again"] == 21


@pytest.mark.parametrize("order", ["metapatch-first", "target-first"])
def test_out_of_range_version_is_not_affected_and_untouched(world, order):
    run = world(version="2.1.0")
    out = run(f'''
        if {order == "target-first"}:
            import fakelib.core
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        r = rows(reg)["fake-compute"]
        print(json.dumps({{"state": r["state"], "reason": r["reason"], "compute": fakelib.core.compute(2),
                          "marker": hasattr(fakelib.core.compute, MARKER),
                          "plain": type(fakelib.core.compute).__name__}}))
    ''')
    assert out["state"] == "not-affected" and "2.1.0" in out["reason"] and "2.0" in out["reason"]
    assert out["compute"] == 20 and not out["marker"] and out["plain"] == "function"


def test_out_of_range_target_object_is_identical(world):
    out = world(version="0.9")('''
        import fakelib.core
        orig = fakelib.core.compute
        reg = Registry(load_patches("fakepatches")); reg.install()
        print(json.dumps({"same": fakelib.core.compute is orig, "thing": states(reg)["fake-thing"]}))
    ''')
    assert out == {"same": True, "thing": "not-affected"}


def test_prerelease_and_local_versions_are_in_range(world):
    out = world(version="1.3.0.dev1+cu124")('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        print(json.dumps(states(reg)))
    ''')
    assert out["fake-compute"] == "applied"


STALE_CORE = FAKELIB_CORE.replace("return x * 10", "return x * 10 + 0")


@pytest.mark.parametrize("order", ["metapatch-first", "target-first"])
def test_changed_source_is_stale_skipped_and_warned_once(world, order, tmp_path):
    run = world()
    (tmp_path / "fakelib" / "core.py").write_text(STALE_CORE)  # upstream changed after the patch was written
    out = run(f'''
        caught = []
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            if {order == "target-first"}:
                import fakelib.core
            reg = Registry(load_patches("fakepatches")); reg.install()
            import fakelib.core
            reg.install(); reg.status()
            caught = [str(x.message) for x in w if issubclass(x.category, MetapatchWarning)]
        r = rows(reg)
        print(json.dumps({{"state": r["fake-compute"]["state"], "reason": r["fake-compute"]["reason"],
                          "other": r["fake-thing"]["state"], "compute": fakelib.core.compute(2), "warnings": caught}}))
    ''')
    assert out["state"] == "stale" and "changed upstream" in out["reason"]
    assert out["other"] == "applied"  # one stale patch does not take the others down
    assert out["compute"] == 20
    assert len(out["warnings"]) == 1 and "fake-compute" in out["warnings"][0]


@pytest.mark.parametrize("order", ["metapatch-first", "target-first"])
def test_strict_mode_turns_stale_into_an_error(world, order, tmp_path):
    run = world()
    (tmp_path / "fakelib" / "core.py").write_text(STALE_CORE)
    out = run(f'''
        raised = None
        try:
            if {order == "target-first"}:
                import fakelib.core
            reg = Registry(load_patches("fakepatches")); reg.install()
            import fakelib.core
        except MetapatchError as exc:
            raised = str(exc)
        print(json.dumps({{"raised": raised}}))
    ''', env={"METAPATCH_STRICT": "1"})
    assert out["raised"] and "fake-compute" in out["raised"] and "stale" in out["raised"]


def test_a_raising_patch_is_failed_others_applied_import_works(world):
    patches = dict(PATCHES)
    patches["p_broken"] = '''
from metapatch import Patch, Target
from fakepatches import FP

def _boom(original):
    raise RuntimeError("patch bug")

PATCH = Patch(id="fake-broken", title="raises while applying", affects={"fakelib": ">=1"},
              targets=(Target("fakelib.core", "compute", FP["fakelib.core:compute"], replacement=_boom),))
'''
    out = world(patches=patches)('''
        records = []
        logging.getLogger("metapatch").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r.getMessage())})())
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            reg = Registry(load_patches("fakepatches")); reg.install()
            import fakelib.core
            reg.install()
            caught = [str(x.message) for x in w if issubclass(x.category, MetapatchWarning)]
        r = rows(reg)
        print(json.dumps({"states": states(reg), "reason": r["fake-broken"]["reason"], "compute": fakelib.core.compute(2),
                          "warnings": caught, "logged": [m for m in records if "fake-broken" in m]}))
    ''')
    assert out["states"] == {"fake-broken": "failed", "fake-compute": "applied", "fake-thing": "applied"}
    assert "RuntimeError: patch bug" in out["reason"]
    assert out["compute"] == 21
    assert len(out["warnings"]) == 1 and len(out["logged"]) == 1


@pytest.mark.parametrize("value,expected", [
    ("fake-compute", {"fake-compute": "disabled", "fake-thing": "applied"}),
    ("fake-compute, fake-thing", {"fake-compute": "disabled", "fake-thing": "disabled"}),
    ("all", {"fake-compute": "disabled", "fake-thing": "disabled"}),
])
def test_metapatch_disable(world, value, expected):
    out = world()('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        print(json.dumps({"states": states(reg), "compute": fakelib.core.compute(2)}))
    ''', env={"METAPATCH_DISABLE": value})
    assert out["states"] == expected
    assert out["compute"] == (20 if expected["fake-compute"] == "disabled" else 21)


def test_metapatch_disable_unknown_id_warns(world):
    out = world()('''
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            reg = Registry(load_patches("fakepatches")); reg.install()
        print(json.dumps([str(x.message) for x in w if issubclass(x.category, MetapatchWarning)]))
    ''', env={"METAPATCH_DISABLE": "fake-compute,no-such-patch"})
    assert len(out) == 1 and "no-such-patch" in out[0] and "fake-thing" in out[0]


def test_concurrent_imports_and_installs_never_double_wrap(world):
    out = world()('''
        import threading
        reg = Registry(load_patches("fakepatches"))
        barrier = threading.Barrier(8)
        def worker(i):
            barrier.wait()
            if i % 2:
                reg.install()
            import fakelib.core
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        [t.start() for t in threads]; [t.join() for t in threads]
        reg.install()
        import fakelib.core
        f = fakelib.core.compute
        print(json.dumps({"compute": f(2), "inner_is_plain": type(f.__wrapped__).__name__ == "function",
                          "states": states(reg)}))
    ''')
    assert out["compute"] == 21 and out["inner_is_plain"]
    assert out["states"]["fake-compute"] == "applied"


def test_second_registry_adopts_instead_of_double_wrapping(world):
    # What importlib.reload(metapatch._framework.registry) or a re-import after clearing sys.modules amounts to.
    out = world()('''
        import fakelib.core
        orig = fakelib.core.compute
        first = Registry(load_patches("fakepatches")); first.install()
        second = Registry(load_patches("fakepatches")); second.install()
        twice = fakelib.core.compute(2)
        second.unpatch()
        print(json.dumps({"twice": twice, "restored": fakelib.core.compute is orig, "states": states(second)}))
    ''')
    assert out["twice"] == 21 and out["restored"]


def test_reloading_metapatch_itself_never_double_wraps(world, tmp_path):
    # The real package, with the fake patches standing in for metapatch.patches.
    out = world()('''
        import importlib, metapatch, metapatch._framework.registry as R
        R.REGISTRY = Registry(load_patches("fakepatches")); metapatch.registry = R.REGISTRY; metapatch.install()
        import fakelib.core
        importlib.reload(metapatch)
        import metapatch as again
        again.install()
        print(json.dumps({"compute": fakelib.core.compute(2), "same_registry": again.registry is R.REGISTRY}))
    ''')
    assert out == {"compute": 21, "same_registry": True}


def test_reloaded_target_is_reported_then_reapplied_once(world):
    out = world()('''
        import importlib
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        importlib.reload(fakelib.core)
        after_reload = rows(reg)["fake-compute"]
        unpatched = fakelib.core.compute(2)
        reg.install()
        print(json.dumps({"state": after_reload["state"], "reason": after_reload["reason"], "unpatched": unpatched,
                          "reapplied": fakelib.core.compute(2), "states": states(reg)}))
    ''')
    assert out["state"] == "pending-import" and "reload" in out["reason"]
    assert out["unpatched"] == 20 and out["reapplied"] == 21
    assert out["states"] == {"fake-compute": "applied", "fake-thing": "applied"}


def test_unpatch_unknown_id_is_a_clear_error(world):
    out = world()('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        try:
            reg.unpatch(["nope"])
            msg = None
        except ValueError as exc:
            msg = str(exc)
        print(json.dumps(msg))
    ''')
    assert "nope" in out and "fake-compute" in out


def test_import_metapatch_imports_no_heavy_library():
    code = ("import sys, metapatch; heavy = [m for m in ('torch', 'transformers', 'accelerate', 'peft', "
            "'bitsandbytes') if m in sys.modules]; print(heavy); metapatch.status(); "
            "print([m for m in ('torch', 'transformers', 'accelerate', 'peft', 'bitsandbytes') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=_env(REPO)).stdout.splitlines()
    assert out == ["[]", "[]"]


def test_status_cli_json_and_strict_exit_code(world, tmp_path):
    run = world()
    (tmp_path / "fakelib" / "core.py").write_text(STALE_CORE)
    out = run('''
        import io, contextlib, os, metapatch, metapatch._framework.registry as R
        from metapatch.commands import status as cmd
        import fakelib.core
        metapatch.registry = Registry(load_patches("fakepatches"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            metapatch.registry.install()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            lenient = cmd.run(type("A", (), {"json": True, "import_targets": False})())
        data = json.loads(buf.getvalue())
        os.environ["METAPATCH_STRICT"] = "1"
        with contextlib.redirect_stdout(io.StringIO()):
            strict = cmd.run(type("A", (), {"json": False, "import_targets": False})())
        print(json.dumps({"lenient": lenient, "strict": strict, "rows": data}))
    ''')
    assert out["lenient"] == 0 and out["strict"] == 1
    by_id = {row["id"]: row for row in out["rows"]}
    assert by_id["fake-compute"]["state"] == "stale"
    for key in ("state", "reason", "installed", "affects", "upstream", "title"):
        assert key in by_id["fake-thing"]


def test_python_dash_m_status_runs():
    proc = subprocess.run([sys.executable, "-m", "metapatch", "status", "--json"], capture_output=True, text=True,
                          env=_env(REPO))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert all(row["state"] in {"applied", "pending-import", "not-affected", "not-measured", "stale", "conflict",
                                "disabled", "failed"} for row in rows)


def test_patch_index_matches_the_records():
    # metapatch.patches.INDEX lets `import metapatch` register hooks without importing patch modules;
    # it is generated from the records (python -m metapatch.patches --write) and must name exactly
    # what they say.
    import importlib

    from metapatch._framework.patch_loading import index_of_records, render_index
    from metapatch._framework.registry import load_patches

    pkg = importlib.import_module("metapatch.patches")
    records = index_of_records()
    index = {pid: (module, tuple(targets)) for pid, (module, targets) in pkg.INDEX.items()}
    assert index == records, ("metapatch/patches/__init__.py is out of date: run python -m metapatch.patches "
                              f"--write, or use:\n{render_index(records)}")
    assert [p.id for p in load_patches()] == list(records)
    check = subprocess.run([sys.executable, "-m", "metapatch.patches", "--check"], env=_env(REPO),
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_lazy_records_load_with_their_target_only(world, tmp_path):
    run = world()
    with open(tmp_path / "fakepatches" / "__init__.py", "a") as init:
        init.write("INDEX = {'fake-compute': ('p_compute', ('fakelib.core',)), 'fake-thing': ('p_thing', ('fakelib.core',))}\n")
    out = run('''
        from metapatch._framework.registry import lazy_patches
        reg = Registry(lazy_patches("fakepatches")); reg.install()
        loaded_before = sorted(m for m in sys.modules if m.startswith("fakepatches."))
        import fakelib.core
        loaded_after = sorted(m for m in sys.modules if m.startswith("fakepatches."))
        print(json.dumps({"before": loaded_before, "after": loaded_after, "states": states(reg),
                          "order": [r["id"] for r in reg.status()], "compute": fakelib.core.compute(2),
                          "method": fakelib.core.Thing().method(1)}))
    ''')
    assert out["before"] == [] and out["after"] == ["fakepatches.p_compute", "fakepatches.p_thing"]
    assert out["states"] == {"fake-compute": "applied", "fake-thing": "applied"}
    assert out["order"] == ["fake-compute", "fake-thing"]
    assert (out["compute"], out["method"]) == (21, 200)


def test_lazy_records_late_install_and_unindexed_module(world, tmp_path):
    run = world()
    with open(tmp_path / "fakepatches" / "__init__.py", "a") as init:
        init.write("INDEX = {'fake-compute': ('p_compute', ('fakelib.core',))}\n")  # p_thing not indexed
    out = run('''
        from metapatch._framework.registry import lazy_patches
        import fakelib.core
        reg = Registry(lazy_patches("fakepatches")); reg.install()
        print(json.dumps({"states": states(reg), "compute": fakelib.core.compute(2),
                          "method": fakelib.core.Thing().method(1)}))
    ''')
    assert out["states"] == {"fake-compute": "applied", "fake-thing": "applied"}
    assert (out["compute"], out["method"]) == (21, 200)


def test_import_metapatch_imports_no_patch_module():
    code = "import sys, metapatch; print(sorted(m for m in sys.modules if m.startswith('metapatch.patches.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=_env(REPO)).stdout.strip()
    assert out == "[]"


def test_two_patches_of_one_target_both_report_applied(world):
    """Two metapatch patches wrapping the same upstream function (each for its own bug, e.g.
    offloaded-outside-reads and tied-device-map-meta-pointer on accelerate < 1.15): calls go through
    both, and the one wrapped over is still `applied`, not 'pending-import: re-executed'."""
    second = PATCHES["p_compute"].replace('id="fake-compute"', 'id="fake-compute-twice"').replace(
        "_plus_one", "_plus_two").replace("+ 1", "+ 2").replace(',\n                    aliases=("fakelib:compute",)', "")
    out = world(patches={"p_compute": PATCHES["p_compute"], "p_compute_twice": second})('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        print(json.dumps({"states": states(reg), "compute": fakelib.core.compute(2)}))
    ''')
    assert out["states"] == {"fake-compute": "applied", "fake-compute-twice": "applied"}
    assert out["compute"] == 23  # 2 * 10, + 1, + 2: both wrappers run


def _stacked(outer_declares: bool = True) -> dict:
    """fake-compute and fake-compute-twice on one target; ``wraps_over`` puts -twice outside."""
    second = PATCHES["p_compute"].replace('id="fake-compute"', 'id="fake-compute-twice"').replace(
        "_plus_one", "_plus_two").replace("+ 1", "+ 2").replace(',\n                    aliases=("fakelib:compute",)', "")
    if outer_declares:
        second = second.replace('upstream=Upstream(', 'wraps_over=("fake-compute",), upstream=Upstream(')
    # Named so that file order alone would put -twice inside: only the declaration orders the stack.
    return {"p_z_compute": PATCHES["p_compute"], "p_a_compute_twice": second}


def test_stacked_patches_follow_their_declared_order(world):
    out = world(patches=_stacked())('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        from metapatch._framework.targets import MARKER
        outer = getattr(fakelib.core.compute, MARKER)[0]
        print(json.dumps({"outer": outer, "compute": fakelib.core.compute(2)}))
    ''')
    assert out == {"outer": "fake-compute-twice", "compute": 23}


def test_unpatching_the_inner_patch_of_a_stack_leaves_no_wrapper_inside_the_outer(world):
    out = world(patches=_stacked())('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core, fakelib
        steps = {"both": fakelib.core.compute(2)}
        reg.unpatch(["fake-compute"])
        steps["inner off"] = fakelib.core.compute(2)
        steps["inner off states"] = states(reg)
        reg.install(["fake-compute"])
        steps["inner back"] = fakelib.core.compute(2)
        steps["outer after reinstall"] = getattr(fakelib.core.compute, MARKER)[0]
        reg.unpatch(["fake-compute-twice"])
        steps["outer off"] = fakelib.core.compute(2)
        reg.unpatch()
        steps["all off"] = fakelib.core.compute(2)
        steps["original back"] = fakelib.core.compute is getattr(sys.modules["fakelib.core"], "compute") \
            and not hasattr(fakelib.core.compute, MARKER)
        print(json.dumps(steps))
    ''')
    assert out["both"] == 23
    assert out["inner off"] == 22  # only the outer's +2: the inner wrapper is gone from inside it
    assert out["inner off states"] == {"fake-compute": "disabled", "fake-compute-twice": "applied"}
    assert out["inner back"] == 23 and out["outer after reinstall"] == "fake-compute-twice"
    assert out["outer off"] == 21
    assert out["all off"] == 20 and out["original back"] is True


def test_shipped_records_derive_their_diffs():
    # A patch's diffs are what upstream_diffs/<id>/ holds, derived only: a record that listed them would
    # be a second source that drifts (diffs= is for a test's fake patch, whose diffs live elsewhere).
    from metapatch._framework import layout
    from metapatch._framework.diff_files import diff_paths_of
    from metapatch._framework.registry import load_patches

    records = load_patches()
    assert [p.id for p in records if p.declared_diffs is not None] == []
    assert all(layout.diffs(p) == diff_paths_of(p.id) for p in records)
    assert any(layout.diffs(p) for p in records)  # the derived ones are really found


def test_patches_sharing_a_target_declare_their_order():
    # Two patches of one target are applied in the order Patch.wraps_over declares; without a
    # declaration the order would follow file names, and a rename would silently change it.
    from collections import defaultdict

    from metapatch._framework.registry import load_patches

    records = {p.id: p for p in load_patches()}
    by_target = defaultdict(list)
    for patch in records.values():
        for target in patch.targets:
            by_target[target.dotted].append(patch.id)
    undeclared = {dotted: ids for dotted, ids in by_target.items() if len(ids) > 1 and not all(
        any(a in records[b].wraps_over or b in records[a].wraps_over for b in ids if b != a) for a in ids)
        and len({tuple(sorted(records[i].affects.items())) for i in ids}) == len(ids)
        and _ranges_overlap([records[i] for i in ids])}
    assert undeclared == {}, "declare Patch.wraps_over for " + repr(undeclared)
    for patch in records.values():
        assert set(patch.wraps_over) <= set(records), f"{patch.id} wraps over an unknown patch"


def test_patches_sharing_a_target_read_one_fingerprint_list():
    # A target two records wrap has its fingerprints declared once (metapatch.patches._shared_targets): each
    # record lists a tail of that list (from the first release it claims), never a copy of its own.
    from collections import defaultdict

    from metapatch._framework.registry import load_patches
    from metapatch.patches._shared_targets import FINGERPRINTS

    by_target = defaultdict(list)
    for patch in load_patches():
        for target in patch.targets:
            by_target[target.dotted].append((patch.id, target.fingerprints))
    shared = {dotted: found for dotted, found in by_target.items() if len({i for i, _ in found}) > 1}
    ids = {dotted: tuple(v[0] for v in variants) for dotted, variants in FINGERPRINTS.items()}
    # the -v4 siblings of ModuleUtilsMixin.device patch disjoint release lines: nothing to share
    for dotted, found in shared.items():
        if dotted not in ids:
            assert not set.intersection(*(set(f) for _, f in found)), f"{dotted}: declare it in _shared_targets"
            continue
        for patch_id, fingerprints in found:
            assert fingerprints and ids[dotted][-len(fingerprints):] == fingerprints, (patch_id, dotted)
    assert set(ids) <= set(shared), "a shared list no longer shared: move it back into its record"


def _ranges_overlap(patches) -> bool:
    """Whether some release of every shared distribution is in all the patches' ranges (the -v4
    siblings of one target never apply together)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    shared = set.intersection(*(set(p.affects) for p in patches))
    probes = [Version(f"{major}.{minor}.0") for major in range(0, 8) for minor in range(0, 60)]
    for dist in shared:
        if not any(all(SpecifierSet(p.affects[dist]).contains(v, prereleases=True) for p in patches) for v in probes):
            return False
    return True


def test_patch_selftest_is_the_module_of_its_own_scenarios():
    # A patch's selftest module is where its own scenarios are (Scenario.patch_id); a record names a module
    # only when the patch has no scenario of its own (another patch's scenarios exercise it), and then it
    # must hold scenarios.
    from metapatch._framework import layout
    from metapatch._framework.registry import load_patches
    from metapatch.selftest import all_scenarios

    scenarios = all_scenarios()
    own = {}
    for scenario in scenarios:
        own.setdefault(scenario.patch_id, []).append(scenario.function.partition(":")[0])
    for patch in load_patches():
        if patch.id in own:
            assert patch.declared_selftest is None, f"{patch.id} declares selftest=: it is derived from its scenarios"
            declared = importlib.import_module(layout.scenarios(patch)).SCENARIOS  # selftest/<id>.py declares them
            assert [s for s in declared if s.patch_id == patch.id], (patch.id, layout.scenarios(patch))
        else:
            assert patch.declared_selftest is not None, f"{patch.id} has no scenario: name the module that exercises it"
            assert any(s.function.startswith(layout.scenarios(patch) + ":") for s in scenarios), patch.id


WRAPPED_METHOD = {"p_method": '''
from metapatch import Patch, Target
from fakepatches import FP

def _times_hundred(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 100

PATCH = Patch(
    id="fake-method", title="Thing.method needs scaling", affects={"fakelib": ">=1.0"},
    targets=(Target("fakelib.core", "Thing.method", FP["fakelib.core:Thing.method"], wrapper=_times_hundred),),
)
'''}


def test_a_wrapped_method_held_bound_by_an_object_copies_as_a_bound_method_does(world):
    """accelerate keeps a hooked module's own ``forward`` as ``module._old_forward``: a deep copy of the model copies
    it. wrapt's proxies refuse copying; metapatch's wrapper binds to the copy, as a bound method does."""
    out = world(patches=WRAPPED_METHOD)('''
        import copy
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        thing = fakelib.core.Thing()
        thing.old_method = thing.method
        twin, shallow = copy.deepcopy(thing), copy.copy(thing)
        wrapper = fakelib.core.Thing.__dict__["method"]
        print(json.dumps({"state": states(reg)["fake-method"], "original": thing.old_method(1),
                          "copy": twin.old_method(1), "bound_to_copy": twin.old_method.__self__ is twin,
                          "shallow": shallow.old_method(1), "shallow_bound_to": shallow.old_method.__self__ is thing,
                          "function_copies_as_itself": copy.deepcopy(wrapper) is wrapper}))
    ''')
    assert out == {"state": "applied", "original": 200, "copy": 200, "bound_to_copy": True, "shallow": 200,
                   "shallow_bound_to": True, "function_copies_as_itself": True}


def test_adopt_existing_runs_once_per_late_application_after_the_swap_and_never_breaks_the_import(world):
    """``Patch(adopt_existing=...)``: called with the target module once the patch is in place on a module imported
    before it (so it can adopt what upstream made before, a model dispatched before ``import metapatch``), again after an unpatch and re-install,
    never for a stale patch; what it raises is logged and the import goes on."""
    adopting = PATCHES["p_compute"].replace("PATCH = Patch(", '''
CALLS = []
def _adopt(module):
    CALLS.append((module.__name__, module.compute(2)))  # the wrapper is in place already
    if len(CALLS) == 2:
        raise ValueError("adoption failed")

PATCH = Patch(adopt_existing=_adopt,''')
    out = world(patches={"p_compute": adopting})('''
        import fakelib.core
        reg = Registry(load_patches("fakepatches")); reg.install()
        from fakepatches.p_compute import CALLS
        first = list(CALLS)
        reg.status()  # asking again applies nothing again
        after_status = list(CALLS)
        reg.unpatch(); reg.install(["fake-compute"])
        print(json.dumps({"first": first, "after_status": after_status, "calls": CALLS, "states": states(reg),
                          "compute": fakelib.core.compute(2)}))
    ''')
    assert out["first"] == out["after_status"] == [["fakelib.core", 21]]
    assert out["calls"] == [["fakelib.core", 21], ["fakelib.core", 21]]  # the second raised: logged, still applied
    assert out["states"]["fake-compute"] == "applied" and out["compute"] == 21


def test_adopt_existing_is_not_called_for_a_stale_patch(world, tmp_path):
    adopting = PATCHES["p_compute"].replace("PATCH = Patch(", '''
CALLS = []
PATCH = Patch(adopt_existing=lambda module: CALLS.append(module.__name__),''')
    fingerprints = {"fakelib.core:compute": "0000000000000000", "fakelib.core:Thing.method": "0",
                    "fakelib.core:Thing.helper": "0"}
    out = world(patches={"p_compute": adopting}, fingerprints=fingerprints)('''
        import fakelib.core
        reg = Registry(load_patches("fakepatches")); reg.install()
        from fakepatches.p_compute import CALLS
        print(json.dumps({"calls": CALLS, "states": states(reg)}))
    ''')
    assert out["states"]["fake-compute"] == "stale" and out["calls"] == []


def test_adopt_existing_is_not_called_inside_the_targets_own_import(world):
    """metapatch first, then the target: the patch applies while the module executes, when nothing upstream made can
    exist yet; only a later application (unpatch, install) adopts."""
    adopting = PATCHES["p_compute"].replace("PATCH = Patch(", '''
CALLS = []
PATCH = Patch(adopt_existing=lambda module: CALLS.append(module.__name__),''')
    out = world(patches={"p_compute": adopting})('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        from fakepatches.p_compute import CALLS
        first = list(CALLS)
        reg.unpatch(); reg.install(["fake-compute"])
        print(json.dumps({"first": first, "calls": CALLS, "states": states(reg)}))
    ''')
    assert out["states"]["fake-compute"] == "applied"
    assert out["first"] == [] and out["calls"] == ["fakelib.core"]
