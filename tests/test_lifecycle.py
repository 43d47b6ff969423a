"""Lifecycle states beyond the basics of test_registry.py: unpatch() then
install() restores every site, targets replaced by another library are ``conflict``, versions
outside the support window are ``not-measured``, and warnings reach the user once, at the user's
line. Synthetic targets in child interpreters (real import order), plus the real stack where
it is installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "accelerate", "peft", "bitsandbytes")
HAVE_STACK = all(__import__("importlib.util").util.find_spec(m) is not None for m in HEAVY)
needs_stack = pytest.mark.skipif(not HAVE_STACK, reason="needs torch, transformers, accelerate, peft, bitsandbytes")

CORE = '''
import contextlib


def compute(x):
    return x * 10


class Thing:
    def method(self, x):
        return x + 1


@contextlib.contextmanager
def scope(x):
    yield x * 3
'''

PATCHES = {
    "p_compute": '''
from metapatch import Patch, Target, Upstream
from fakepatches import FP

def _plus_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1

PATCH = Patch(id="fake-compute", title="compute is off by one", affects={"fakelib": ">=1.0,<2.0"},
              targets=(Target("fakelib.core", "compute", FP["fakelib.core:compute"], wrapper=_plus_one,
                              aliases=("fakelib:compute",)),),
              upstream=Upstream(fixed_in={"fakelib": "2.0"}))
''',
    "p_thing": '''
from metapatch import Patch, Target
from fakepatches import FP

def _method(original):
    def method(self, x):
        return original(self, x) * 100
    return method

PATCH = Patch(id="fake-thing", title="Thing needs scaling", affects={"fakelib": ">=1.0"},
              targets=(Target("fakelib.core", "Thing.method", FP["fakelib.core:Thing.method"], replacement=_method),))
''',
    "p_scope": '''
from metapatch import Patch, Target
from fakepatches import FP

def _scope(original):
    import contextlib
    @contextlib.contextmanager
    def scope(x):
        with original(x) as value:
            yield value + 1
    return scope

PATCH = Patch(id="fake-scope", title="a decorated upstream function", affects={"fakelib": ">=1.0"},
              targets=(Target("fakelib.core", "scope", FP["fakelib.core:scope"], replacement=_scope),))
''',
}

# Other libraries that patch fakelib the ways unsloth, liger-kernel and axolotl do.
OTHERLIBS = {
    "replaced": '''
import fakelib.core
def compute(x):
    return x * 10
fakelib.core.compute = compute
''',
    "functools-wraps": '''
import functools, fakelib.core
_original = fakelib.core.compute
@functools.wraps(_original)
def compute(x):
    return _original(x)
fakelib.core.compute = compute
''',
    "wrapt": '''
import wrapt
def _through(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)
wrapt.wrap_function_wrapper("fakelib.core", "compute", _through)
''',
    "class": '''
import fakelib.core
class Thing(fakelib.core.Thing):
    def method(self, x):
        return x + 1
fakelib.core.Thing = Thing
''',
}

PRELUDE = '''
import json, sys, warnings
warnings.simplefilter("always")
from metapatch._framework.registry import Registry, load_patches, MARKER
from metapatch import MetapatchError, MetapatchWarning
def rows(reg):
    return {r["id"]: r for r in reg.status()}
def states(reg):
    return {r["id"]: r["state"] for r in reg.status()}
'''


def _env(root: Path, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO)])
    env.update(extra or {})
    return env


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


class World:
    def __init__(self, root: Path, version: str = "1.1.0"):
        self.root = root
        _write(root, "fakelib/__init__.py", "from .core import compute\n")
        _write(root, "fakelib/core.py", CORE)
        _write(root, f"fakelib-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: fakelib\nVersion: {version}\n")
        _write(root, "consumer.py", "from fakelib.core import compute\n")
        _write(root, "consumer2.py", "from fakelib import compute as renamed\n")
        for name, text in OTHERLIBS.items():
            _write(root, f"otherlib_{name.replace('-', '_')}.py", text)
        out = subprocess.run([sys.executable, "-m", "metapatch", "fingerprint", "fakelib.core:compute",
                              "fakelib.core:Thing.method", "fakelib.core:scope"],
                             env=_env(root), capture_output=True, text=True, check=True, cwd=root).stdout
        _write(root, "fakepatches/__init__.py", f"FP = {dict(line.split() for line in out.splitlines())!r}\n")
        for name, text in PATCHES.items():
            _write(root, f"fakepatches/{name}.py", text)

    def run(self, script: str, env=None, check=True) -> dict:
        path = self.root / "user_script.py"
        path.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(script))
        proc = subprocess.run([sys.executable, str(path)], env=_env(self.root, env), capture_output=True,
                              text=True, cwd=self.root, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"script failed:\n{proc.stdout}\n{proc.stderr}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        out["_stderr"] = proc.stderr
        return out


@pytest.fixture
def world(tmp_path):
    return World(tmp_path)


# -- unpatch() then install() ------------------------------------------------------------------


def test_unpatch_then_install_restores_every_site(world):
    out = world.run('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core, fakelib, consumer, consumer2  # both capture the replacement by name
        calls = lambda: [fakelib.core.compute(2), fakelib.compute(2), consumer.compute(2), consumer2.renamed(2)]
        before = calls()
        cycles = []
        for _ in range(2):
            reg.unpatch()
            unpatched = calls()
            reg.install()
            cycles.append({"unpatched": unpatched, "reinstalled": calls(), "state": states(reg)["fake-compute"],
                           "notes": rows(reg)["fake-compute"]["notes"]})
        print(json.dumps({"before": before, "cycles": cycles}))
    ''')
    assert out["before"] == [21, 21, 21, 21]
    for cycle in out["cycles"]:
        assert cycle["unpatched"] == [20, 20, 20, 20]
        assert cycle["reinstalled"] == [21, 21, 21, 21], cycle
        assert cycle["state"] == "applied" and cycle["notes"] == []


def test_name_captured_while_unpatched_is_reported_as_such(world):
    out = world.run('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        reg.unpatch()
        import consumer  # captures the original while metapatch is unpatched
        reg.install()
        print(json.dumps({"consumer": consumer.compute(2), "notes": rows(reg)["fake-compute"]["notes"]}))
    ''')
    assert out["consumer"] == 20  # not rewritten: it never held the replacement ...
    assert len(out["notes"]) == 1 and "consumer" in out["notes"][0] and "unpatched" in out["notes"][0]  # ... but said


def test_reimport_after_removal_from_sys_modules_is_patched(world):
    out = world.run('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core
        for name in [m for m in sys.modules if m == "fakelib" or m.startswith("fakelib.")]:
            del sys.modules[name]
        import fakelib.core as fresh
        patched = fresh.compute(2)
        reg.unpatch()
        print(json.dumps({"patched": patched, "restored": fresh.compute(2), "plain": type(fresh.compute).__name__}))
    ''')
    assert (out["patched"], out["restored"], out["plain"]) == (21, 20, "function")


@needs_stack
def test_real_stack_unpatch_then_install_restores_exact_coverage(tmp_path):
    script = '''
        import json, sys
        import metapatch
        from metapatch._framework.registry import MARKER
        import transformers.integrations.accelerate, transformers.modeling_utils, peft.peft_model, accelerate.hooks
        import bitsandbytes.nn.modules
        def marker(value):
            try:
                found = getattr(value, MARKER, None)
            except BaseException:
                return None
            return found[0] if isinstance(found, tuple) else None
        def coverage():
            sites = set()
            for name, module in list(sys.modules.items()):
                if name.partition(".")[0] not in ("torch", "transformers", "accelerate", "peft", "bitsandbytes"):
                    continue
                namespace = getattr(module, "__dict__", None)
                for attr, value in list(namespace.items()) if isinstance(namespace, dict) else ():
                    if type(value) is type and value.__module__ == name:
                        sites.update((name, f"{value.__name__}.{k}", marker(v)) for k, v in list(vars(value).items()) if marker(v))
                    elif callable(value) and marker(value):
                        sites.add((name, attr, marker(value)))
            return sites
        before = coverage()
        metapatch.unpatch()
        metapatch.install()
        after = coverage()
        rows = metapatch.status()
        print(json.dumps({"before": sorted(before), "after": sorted(after),
                          "notes": {r["id"]: r["notes"] for r in rows if r["notes"]}}))
    '''
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = {tuple(x) for x in out["before"]}, {tuple(x) for x in out["after"]}
    # the modules the issue names hold replacements they imported by name (which ones depends on
    # which patches this stack needs: dispatch_model, infer_auto_device_map, ...)
    holders = {m for m, _, _ in before}
    assert {"transformers.integrations.accelerate", "peft.peft_model"} <= holders, sorted(before)
    assert after == before, {"lost": sorted(before - after), "extra": sorted(after - before)}
    assert out["notes"] == {}


# -- conflict ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(OTHERLIBS))
def test_target_replaced_by_another_library_is_conflict(world, kind):
    module = f"otherlib_{kind.replace('-', '_')}"
    patch = "fake-thing" if kind == "class" else "fake-compute"
    out = world.run(f'''
        import fakelib.core, {module}
        theirs = (fakelib.core.compute, fakelib.core.Thing)
        reg = Registry(load_patches("fakepatches")); reg.install()
        r = rows(reg)
        print(json.dumps({{"state": r["{patch}"]["state"], "reason": r["{patch}"]["reason"], "states": states(reg),
                          "untouched": (fakelib.core.compute, fakelib.core.Thing) == theirs,
                          "marked": hasattr(fakelib.core.Thing.method, MARKER)
                                    if "{patch}" == "fake-thing" else hasattr(fakelib.core.compute, MARKER)}}))
    ''')
    assert out["state"] == "conflict", out
    assert module in out["reason"] and "changed upstream" not in out["reason"]
    assert out["untouched"] and not out["marked"]
    assert out["states"]["fake-scope"] == "applied"  # a decorator from contextlib is upstream's own


def test_target_replaced_after_metapatch_is_reported_as_conflict(world):
    out = world.run('''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core, otherlib_replaced
        after = rows(reg)["fake-compute"]
        reg.install()
        print(json.dumps({"state": after["state"], "reason": after["reason"], "reinstalled": states(reg)["fake-compute"],
                          "compute": fakelib.core.compute(2)}))
    ''')
    assert out["state"] == "conflict" and "otherlib_replaced" in out["reason"] and "after metapatch" in out["reason"]
    assert out["reinstalled"] == "conflict" and out["compute"] == 20


def test_conflict_is_an_error_under_strict_mode(world):
    out = world.run('''
        import fakelib.core, otherlib_replaced
        try:
            Registry(load_patches("fakepatches")).install()
            raised = None
        except MetapatchError as exc:
            raised = str(exc)
        print(json.dumps({"raised": raised}))
    ''', env={"METAPATCH_STRICT": "1"})
    assert out["raised"] and "conflict" in out["raised"] and "otherlib_replaced" in out["raised"]


# -- not-measured ------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["metapatch-first", "target-first"])
def test_version_outside_support_window_is_not_measured(tmp_path, order):
    world = World(tmp_path, version="1.3.0")
    out = world.run(f'''
        if {order == "target-first"}:
            import fakelib.core
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reg = Registry(load_patches("fakepatches"), support_window={{"fakelib": ">=1.0,<1.2"}}); reg.install()
            import fakelib.core
        r = rows(reg)["fake-compute"]
        print(json.dumps({{"states": states(reg), "reason": r["reason"], "compute": fakelib.core.compute(2),
                          "plain": type(fakelib.core.compute).__name__, "warnings": len(caught)}}))
    ''', env={"METAPATCH_STRICT": "1"})  # the truth, not an error
    assert out["states"] == {"fake-compute": "not-measured", "fake-scope": "not-measured", "fake-thing": "not-measured"}
    assert "not measured for fakelib 1.3.0" in out["reason"] and ">=1.0,<1.2" in out["reason"]
    assert "metapatch selftest" in out["reason"]
    assert out["compute"] == 20 and out["plain"] == "function" and out["warnings"] == 0


def test_fixed_upstream_release_outside_the_window_is_not_affected(tmp_path):
    world = World(tmp_path, version="2.1.0")
    out = world.run('''
        reg = Registry(load_patches("fakepatches"), support_window={"fakelib": ">=1.0,<1.2"}); reg.install()
        import fakelib.core
        print(json.dumps({"states": states(reg), "reason": rows(reg)["fake-compute"]["reason"]}))
    ''')
    assert out["states"]["fake-compute"] == "not-affected" and "fixed upstream in 2.0" in out["reason"]
    assert out["states"]["fake-thing"] == "not-measured"  # no fixed release declared: unknown


def test_status_command_shows_not_measured_and_conflict(tmp_path):
    world = World(tmp_path, version="1.3.0")
    out = world.run('''
        import io, contextlib, os, metapatch
        from metapatch.commands import status as cmd
        import fakelib.core, otherlib_class
        metapatch.registry = Registry(load_patches("fakepatches"), support_window={"fakelib": ">=1.0,<1.5"})
        metapatch.registry.install()
        os.environ["METAPATCH_STRICT"] = "1"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            with_conflict = cmd.run(type("A", (), {"json": False, "import_targets": False})())
        metapatch.registry = Registry(load_patches("fakepatches"), support_window={"fakelib": ">=1.0,<1.2"})
        metapatch.registry.install()
        buf2 = io.StringIO()
        with contextlib.redirect_stdout(buf2):
            only_unmeasured = cmd.run(type("A", (), {"json": False, "import_targets": False})())
        print(json.dumps({"conflict_exit": with_conflict, "conflict_text": buf.getvalue(),
                          "unmeasured_exit": only_unmeasured, "unmeasured_text": buf2.getvalue()}))
    ''', check=False)
    assert out["conflict_exit"] == 1 and "fake-thing: conflict" in out["conflict_text"]
    assert "CONFLICT: fake-thing" in out["conflict_text"]
    assert out["unmeasured_exit"] == 0
    assert "fake-compute: not-measured" in out["unmeasured_text"] and "NOT MEASURED" in out["unmeasured_text"]


def test_import_metapatch_reads_neither_the_window_nor_wrapt(tmp_path):
    code = ("import sys, metapatch; print([m for m in ('metapatch.tested_versions', 'wrapt', 'packaging'"
            ") if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=_env(tmp_path), cwd=tmp_path).stdout.strip()
    assert out == "[]"


# -- warnings ----------------------------------------------------------------------------------

STALE_CORE = CORE.replace("return x * 10", "return x * 10 + 0")


@pytest.mark.parametrize("logging_setup", ["none", "basicConfig"])
def test_problem_warning_is_printed_once_at_the_users_line(world, logging_setup):
    (world.root / "fakelib" / "core.py").write_text(STALE_CORE)
    out = world.run(f'''
        import logging
        if "{logging_setup}" == "basicConfig":
            logging.basicConfig()
        warnings.resetwarnings()  # the default filters: what a user sees
        reg = Registry(load_patches("fakepatches")); reg.install()
        import fakelib.core  # LINE-OF-IMPORT
        reg.install(); reg.status()
        print(json.dumps({{"state": states(reg)["fake-compute"]}}))
    ''')
    assert out["state"] == "stale"
    script = (world.root / "user_script.py").read_text().splitlines()
    line = next(i for i, text in enumerate(script, 1) if "LINE-OF-IMPORT" in text)
    stderr = out["_stderr"]
    assert stderr.count("'fake-compute' is stale") == 1, stderr
    assert re.search(rf"user_script\.py:{line}: MetapatchWarning: metapatch: patch 'fake-compute' is stale", stderr), stderr


@needs_stack
def test_split_tied_group_warning_once_per_load_at_the_users_line(tmp_path):
    script = tmp_path / "load_twice.py"
    script.write_text(textwrap.dedent('''
        import json, sys, warnings
        import metapatch
        from transformers import LlamaForCausalLM
        from metapatch.selftest._models import save_tiny_llama
        from metapatch.selftest.tied_device_map_transformers import LLAMA_SPLIT_MAP
        state = {r["id"]: r["state"] for r in metapatch.status()}
        from pathlib import Path
        path = save_tiny_llama(Path(sys.argv[1]) / "ckpt", tie_word_embeddings=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            LlamaForCausalLM.from_pretrained(path, device_map=dict(LLAMA_SPLIT_MAP), offload_folder=sys.argv[1] + "/o1")  # FIRST
            LlamaForCausalLM.from_pretrained(path, device_map=dict(LLAMA_SPLIT_MAP), offload_folder=sys.argv[1] + "/o2")  # SECOND
        tied = [(w.filename, w.lineno) for w in caught if "is tied to" in str(w.message)]
        print(json.dumps({"state": state.get("tied-device-map-transformers"), "tied": tied}))
    '''))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["state"] != "applied":
        pytest.skip(f"tied-device-map-transformers is {out['state']} on this stack")
    lines = script.read_text().splitlines()
    first = next(i for i, text in enumerate(lines, 1) if "# FIRST" in text)
    assert out["tied"] == [[str(script), first], [str(script), first + 1]]
    assert "is tied to" not in proc.stderr  # not also through the logger


# -- a finder inserted ahead of metapatch's (typeguard's and jaxtyping's import hooks) -------------------

AHEAD_FINDER = '''
import importlib.machinery, sys
class Loader(importlib.machinery.SourceFileLoader):  # what an instrumenting import hook returns
    pass
class AheadFinder:
    """Answers fakelib itself, from the path finder, with its own loader, as typeguard's finder does."""
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] != "fakelib":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None:
            spec.loader = Loader(spec.loader.name, spec.loader.path)
        return spec
'''


@pytest.mark.parametrize("then", ["import-other", "status", "import-target-directly"])
def test_target_loaded_by_a_finder_inserted_ahead_is_patched(world, then):
    """A finder another library inserts at sys.meta_path[0] after metapatch loads the target itself.
    Metapatch's finder gets back in front at the next import it sees (and still asks that finder, so the
    module keeps that finder's loader); a target that finder already loaded is patched late, at the next
    import through metapatch's finder or at status(), which says why."""
    _write(world.root, "aheadfinder.py", AHEAD_FINDER)
    _write(world.root, "unrelated_module.py", "X = 1\n")
    out = world.run(f'''
        reg = Registry(load_patches("fakepatches")); reg.install()
        import aheadfinder
        sys.meta_path.insert(0, aheadfinder.AheadFinder())
        then = {then!r}
        if then == "import-target-directly":
            import unrelated_module  # metapatch's finder sees an import and gets back in front
        import fakelib.core
        before = fakelib.core.compute(2)
        if then == "import-other":
            import unrelated_module
        elif then == "status":
            reg.status()
        row = rows(reg)["fake-compute"]
        print(json.dumps({{"before": before, "after": fakelib.core.compute(2), "state": row["state"],
                          "notes": row["notes"], "loader": type(fakelib.core.__loader__).__name__,
                          "first": type(sys.meta_path[0]).__name__}}))
    ''')
    assert out["loader"] == "Loader"  # the other finder's loader is kept
    assert out["state"] == "applied" and out["after"] == 21, out
    assert out["first"] == "PostImportFinder"
    if then == "import-target-directly":
        assert out["before"] == 21 and out["notes"] == []  # patched as it finished executing, as usual
    else:
        assert out["before"] == 20  # loaded by the finder ahead before metapatch's could see it ...
        (note,) = out["notes"]  # ... and said, once, with the loader and the finder found ahead
        assert "fakelib.core" in note and "aheadfinder.AheadFinder" in note and "aheadfinder.Loader" in note
        # (status() itself imports, through metapatch's finder, which may catch up first)
        assert "next import through metapatch's finder" in note or (then == "status" and "status()" in note)
