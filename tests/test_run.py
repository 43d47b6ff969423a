"""``metapatch run``: the program runs with metapatch imported in its own process and in every Python
child (subprocess, multiprocessing spawn, ``accelerate launch``), and sees exactly the argv, stdin,
exit code and signals it would see without metapatch.

The probe script records whether metapatch was imported *before* it imports anything itself, then
imports a patch target (accelerate.hooks) and reads the state of accelerate-emptiness-probe through
the metapatch the bootstrap imported. A plain ``python probe.py`` is the control: there metapatch is
not imported at all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import metapatch
from metapatch._bootstrap import BOOTSTRAP_DIR

REPO = Path(metapatch.__file__).resolve().parents[1]
PATCH_ID = "accelerate-emptiness-probe"

PROBE = textwrap.dedent('''
    import json, os, sys
    imported_at_start = "metapatch" in sys.modules  # before this script imports anything


    def report(tag):
        state = None
        try:
            import accelerate.hooks  # noqa: F401 - a patch target
        except ImportError:
            state = "no-accelerate"
        if imported_at_start and state is None:
            rows = sys.modules["metapatch"].status()
            state = next(r["state"] for r in rows if r["id"] == "accelerate-emptiness-probe")
        path = os.path.join(os.environ["PROBE_OUT"], f"{tag}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"tag": tag, "imported": imported_at_start, "state": state, "argv": sys.argv[1:],
                       "pid": os.getpid()}, f)


    def spawned():
        report("spawn")


    if __name__ == "__main__":
        mode = sys.argv[1]
        if mode == "report":
            report("main")
        elif mode == "subprocess":
            report("main")
            import subprocess
            subprocess.run([sys.executable, __file__, "report"], check=True)
        elif mode == "spawn":
            import multiprocessing
            child = multiprocessing.get_context("spawn").Process(target=spawned)
            child.start()
            child.join()
            sys.exit(child.exitcode)
        elif mode == "exit":
            sys.exit(int(sys.argv[2]))
        elif mode == "echo-stdin":
            sys.stdout.write(sys.stdin.read().upper())
        elif mode == "wait-for-signal":
            import signal, time
            signal.signal(signal.SIGUSR1, lambda *a: sys.exit(42))
            report("main")
            time.sleep(60)
            sys.exit(1)
''')


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def _env(out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("METAPATCH_DISABLE", "METAPATCH_AUTOLOAD")}
    env["PROBE_OUT"] = str(out)
    # console scripts of this environment (accelerate) first, as in an activated venv
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # the test runs from a source checkout, metapatch need not be installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return env


def _metapatch_run(*args, out, cwd, **kwargs):
    return subprocess.run([sys.executable, "-m", "metapatch", "run", *map(str, args)], env=_env(out), cwd=cwd,
                          capture_output=True, text=True, timeout=300, **kwargs)


def _reports(out: Path) -> list:
    return sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r["tag"])


def _reference_state(tmp_path) -> str:
    """The patch's state when a process imports metapatch itself (what run must reproduce)."""
    code = f"import metapatch, accelerate.hooks; print([r['state'] for r in metapatch.status() if r['id'] == {PATCH_ID!r}][0])"
    env = {k: v for k, v in os.environ.items() if k != "METAPATCH_DISABLE"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"accelerate is not importable here: {done.stderr.strip()[-200:]}")
    state = done.stdout.strip()
    if state != "applied":
        pytest.skip(f"{PATCH_ID} is {state} with the installed accelerate, not applied: nothing to compare with")
    return state


def test_control_without_run_nothing_imports_metapatch(probe, tmp_path):
    script, out = probe
    subprocess.run([sys.executable, str(script), "report"], env=_env(out), cwd=tmp_path, check=True, timeout=300)
    assert [(r["imported"], r["state"]) for r in _reports(out)] == [(False, None)]


def test_script_argv_and_patch_state(probe, tmp_path):
    script, out = probe
    expected = _reference_state(tmp_path)
    done = _metapatch_run(script, "report", "two words", "--flag", "-m", "x", out=out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [main] = _reports(out)
    assert main["imported"] and main["state"] == expected
    assert main["argv"] == ["report", "two words", "--flag", "-m", "x"]


def test_module_form(probe, tmp_path):
    script, out = probe
    expected = _reference_state(tmp_path)
    done = _metapatch_run("-m", "probe", "report", "--x", out=out, cwd=script.parent)
    assert done.returncode == 0, done.stderr
    [main] = _reports(out)
    assert (main["imported"], main["state"], main["argv"]) == (True, expected, ["report", "--x"])


def test_subprocess_child_is_patched(probe, tmp_path):
    script, out = probe
    expected = _reference_state(tmp_path)
    done = _metapatch_run(script, "subprocess", out=out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    reports = _reports(out)
    assert len(reports) == 2 and len({r["pid"] for r in reports}) == 2
    assert all(r["imported"] and r["state"] == expected for r in reports), reports


def test_multiprocessing_spawn_child_is_patched(probe, tmp_path):
    script, out = probe
    expected = _reference_state(tmp_path)
    done = _metapatch_run(script, "spawn", out=out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [child] = _reports(out)
    assert child["tag"] == "spawn" and child["imported"] and child["state"] == expected


def test_accelerate_launch_child_is_patched(probe, tmp_path):
    script, out = probe
    expected = _reference_state(tmp_path)
    if not (Path(sys.executable).parent / "accelerate").exists() and shutil.which("accelerate") is None:
        pytest.skip("no accelerate console script in this environment")
    done = _metapatch_run("accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                          "--mixed_precision", "no", "--dynamo_backend", "no", script, "report", "--lr", "3",
                          out=out, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [child] = _reports(out)
    assert child["imported"] and child["state"] == expected
    assert child["argv"] == ["report", "--lr", "3"]


def test_exit_code_and_stdin_pass_through(probe, tmp_path):
    script, out = probe
    assert _metapatch_run(script, "exit", "3", out=out, cwd=tmp_path).returncode == 3
    assert _metapatch_run(script, "exit", "0", out=out, cwd=tmp_path).returncode == 0
    echoed = _metapatch_run(script, "echo-stdin", out=out, cwd=tmp_path, input="line one\nline two\n")
    assert echoed.returncode == 0 and echoed.stdout == "LINE ONE\nLINE TWO\n"


def test_program_replaces_metapatch_and_receives_signals(probe, tmp_path):
    script, out = probe
    proc = subprocess.Popen([sys.executable, "-m", "metapatch", "run", str(script), "wait-for-signal"],
                            env=_env(out), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("*.json")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        [main] = _reports(out)
        assert main["pid"] == proc.pid  # exec'ed: no metapatch process in between
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == 42
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_program_not_found_and_nothing_to_run(tmp_path):
    out = tmp_path
    missing = _metapatch_run("no-such-program-metapatch-test", out=out, cwd=tmp_path)
    assert missing.returncode == 127 and "command not found" in missing.stderr
    assert _metapatch_run(out=out, cwd=tmp_path).returncode == 2


def test_users_own_sitecustomize_still_runs(probe, tmp_path):
    script, out = probe
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import os, sys\nos.environ['THEIR_SITECUSTOMIZE'] = 'ran'\n"
        "sys.THEIR_METAPATCH_SEEN = 'metapatch' in sys.modules\n")
    check = tmp_path / "check.py"
    check.write_text("import os, sys, sitecustomize\n"
                     "print(os.environ.get('THEIR_SITECUSTOMIZE'), sys.THEIR_METAPATCH_SEEN, 'metapatch' in sys.modules,\n"
                     "      sitecustomize.__file__)\n")
    env = _env(out)
    env["PYTHONPATH"] = os.pathsep.join([str(theirs), env["PYTHONPATH"]])
    done = subprocess.run([sys.executable, "-m", "metapatch", "run", str(check)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ran, metapatch_first, imported, module_file = done.stdout.split()
    assert (ran, metapatch_first, imported) == ("ran", "True", "True")
    assert Path(module_file) == theirs / "sitecustomize.py"  # theirs is `sitecustomize` afterwards


@pytest.mark.parametrize("broken", ["raises", "missing"])
def test_bootstrap_never_breaks_the_interpreter(tmp_path, broken):
    home = tmp_path / "home"
    (home / "metapatch").mkdir(parents=True)
    if broken == "raises":
        (home / "metapatch" / "__init__.py").write_text("raise RuntimeError('deliberately broken')\n")
    else:
        home = tmp_path / "nothing-here"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    if broken == "missing":
        installed = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(bool(u.find_spec('metapatch')))"],
                                   env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout.strip()
        if installed == "True":
            pytest.skip("metapatch is installed in this environment: it cannot be missing here")
    env.update(PYTHONPATH=BOOTSTRAP_DIR, METAPATCH_BOOTSTRAP_HOME=str(home))
    done = subprocess.run([sys.executable, "-c", "import sys; print('started', 'metapatch' in sys.modules)"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["started", "False"]
    if broken == "raises":
        assert "metapatch: not active in this process (RuntimeError: deliberately broken)" in done.stderr
    else:
        assert done.stderr == ""
