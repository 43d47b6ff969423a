"""METAPATCH_DEBUG=1 / `metapatch run --report`: at exit each process says which patches applied and how often
each one's code ran; without it the registry installs the patches' objects as written (nothing counts)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[1]

# A real dispatch_model with a block on disk: accelerate's hook attachment goes through the patched
# attach_execution_device_hook (accelerate-emptiness-probe) once per module below the dispatched ones.
PROGRAM = textwrap.dedent('''
    import sys
    import torch
    from accelerate import dispatch_model
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2)))
    model = dispatch_model(model, {"0": "cpu", "1": "disk"}, main_device="cpu", offload_dir=sys.argv[1])
    print("output", tuple(model(torch.ones(1, 4)).shape))
    sys.exit(7)
''')


def _run(tmp_path: Path, *metapatch_args: str, env_extra=None) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "metapatch", "run", *metapatch_args, str(script),
                           str(tmp_path / "offload")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def _report(stderr: str) -> list:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("metapatch run report (pid "))
    return lines[start:]


def test_run_report_names_the_patches_that_ran_with_counts(tmp_path):
    done = _run(tmp_path, "--report")
    assert done.returncode == 7 and "output (1, 2)" in done.stdout, done.stderr[-3000:]
    report = _report(done.stderr)
    assert "program.py" in report[0]
    ran = {line.split()[1].rstrip(":"): line for line in report if line.startswith("  ran ")}
    line = ran["accelerate-emptiness-probe"]
    calls = int(line.split(": ")[1].split()[0])
    assert calls >= 3 and f"accelerate.hooks:attach_execution_device_hook {calls}" in line, line
    idle = [line.split()[1].rstrip(":") for line in report if line.startswith("  idle ")]
    assert "accelerate-tie-before-load" in idle  # applied (accelerate is imported), never called here
    assert "accelerate-tie-before-load" not in ran
    # a patch whose library is installed but never imported by the program waits for it: peft's (where peft is
    # installed: the GPU image has none) or transformers' (the program imports no transformers either)
    pending = "peft-offload-redispatch" if importlib.util.find_spec("peft") else "tied-device-map-transformers"
    assert any(line.startswith("  pending ") and pending in line for line in report), report
    assert report[-1].startswith("  this run needed metapatch for: accelerate")


def test_the_environment_variable_alone_reports_and_without_it_nothing_does(tmp_path):
    done = _run(tmp_path, env_extra={"METAPATCH_DEBUG": "1"})
    assert done.returncode == 7 and _report(done.stderr)
    quiet = _run(tmp_path)
    assert quiet.returncode == 7 and "metapatch run report" not in quiet.stderr


def test_counting_off_installs_the_patches_as_written():
    code = textwrap.dedent('''
        import metapatch, accelerate.hooks, accelerate.utils.modeling
        from metapatch.patches.accelerate_emptiness_probe import PATCH as probe
        from metapatch.patches.accelerate_tie_before_load import PATCH as tie
        from metapatch._framework import firing as _firing
        wrapped = accelerate.utils.modeling.load_checkpoint_in_model
        while getattr(wrapped, "_self_wrapper", None) is not None and wrapped._self_wrapper not in [
                t.wrapper for t in tie.targets]:
            wrapped = wrapped.__wrapped__
        assert wrapped._self_wrapper in [t.wrapper for t in tie.targets], "tie-before-load's wrapper was replaced"
        assert accelerate.hooks.attach_execution_device_hook.__code__.co_name == "attach_execution_device_hook"
        assert _firing.COUNTS == {} and not _firing._REPORTING
        print("ok")
    ''')
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
