"""`metapatch diffs check --run` on a real patch and its real upstream diff (a subprocess, as a
patch author runs it): the scenarios fail on the installed bitsandbytes and pass with the diff.
CI runs this file once, in the latest environment (noxfile ONCE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCH = "bnb-quant-state-offload"

pytest.importorskip("bitsandbytes", reason="the diff is for bitsandbytes, which is not installed here")


def test_diffs_check_run_proves_the_bitsandbytes_diff_by_behaviour(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("METAPATCH_DIFFS_ROOT", "METAPATCH_DISABLE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-m", "metapatch", "diffs", "check", PATCH, "--run", "--json"],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=900)
    report = json.loads(proc.stdout or "{}")
    [row] = report["diffs"]
    if row["verdict"] != "applies":
        pytest.skip(f"the installed bitsandbytes {row['installed']} is {row['verdict']} for the diff")
    [run] = report["runs"]
    assert run["scenarios"], run
    for key, scenario in run["scenarios"].items():
        assert scenario["without_diff"]["result"] == "fail", (key, scenario)
        assert scenario["with_diff"]["result"] == "pass", (key, scenario)
    assert (run["result"], proc.returncode) == ("pass", 0), proc.stdout[-2000:]
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran
