"""`metapatch.unpatch(id)` then `metapatch.install()` on the real stack: every patch comes back once, without a
warning. Two patches wrap accelerate's load_checkpoint_in_model (accelerate-tie-before-load, then
empty-init-nonpersistent-buffers over it); re-installing must not wrap the inner one a second time, nor warn that
a module captured the function "before metapatch was imported" (it was imported first)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[1]

CODE = r"""
import json, warnings
import metapatch
from metapatch._targets import MARKER
import accelerate, accelerate.hooks, accelerate.big_modeling, accelerate.utils.modeling, accelerate.utils.bnb

def chain(obj):
    ids = []
    for _ in range(8):
        marker = getattr(obj, MARKER, None)
        if not marker:
            break
        ids.append(marker[0])
        obj = marker[2]
    return ids

before = chain(accelerate.utils.modeling.load_checkpoint_in_model)
messages = []
for row in metapatch.status():
    if row["state"] != "applied":
        continue
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metapatch.unpatch(row["id"])
        metapatch.install()
    messages += [f"{row['id']}: {w.message}" for w in caught if "metapatch" in str(w.message)]
print(json.dumps({"before": before, "after": chain(accelerate.utils.modeling.load_checkpoint_in_model),
                  "bnb": chain(accelerate.utils.bnb.load_checkpoint_in_model), "messages": messages,
                  "states": {r["id"]: r["state"] for r in metapatch.status()}}))
"""


def test_unpatch_then_install_restores_every_patch_once_without_warnings():
    done = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "METAPATCH_STRICT": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    assert data["messages"] == []
    assert data["before"], "no metapatch patch on load_checkpoint_in_model: pick another shared target"
    assert sorted(data["after"]) == sorted(data["before"]) and len(set(data["after"])) == len(data["after"])
    assert data["bnb"] == data["after"]  # the module that imported it by name calls the same chain
