"""The peft diff series of `peft-offload-redispatch`, applied alone, over initialisations that rewrite the
base weights (PiSSA, OLoRA write the residual ``W - s·B·A`` into ``base_layer.weight``) with a target layer on
disk: upstream fails loudly (``Attempted to call variable.set_data(tensor)``); the series onloads the layer
while the adapter is created, so without a check the residual would be dropped when the layer is offloaded
again (measured before the check: logits 0.17 (PiSSA) and 0.28 (OLoRA) off the in-memory model, no error).
With the series the PR must be loud too (a ValueError naming the weights), and plain LoRA must still equal
the in-memory model. metapatch itself keeps the residual (tests/patches/test_offload_store.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from metapatch.diffs import diffs_for

from _three_way import upstream_diff_copy  # tests/patches/_three_way.py

pytestmark = pytest.mark.slow

FLOW = r'''
import copy, json, sys, tempfile, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
root = Path(tempfile.mkdtemp(dir=sys.argv[1]))
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(root / "ckpt")
MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
       "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
out = {}
for init in ("pissa", "olora", True):
    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "ckpt").eval(), copy.deepcopy(cfg))
    try:
        off = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "ckpt", device_map=MAP,
                             offload_folder=str(root / f"off-{init}")).eval(), copy.deepcopy(cfg))
        with torch.no_grad():
            out[str(init)] = ["equal" if torch.equal(ref(ids).logits, off(ids).logits) else "differs", ""]
    except Exception as error:
        out[str(init)] = [type(error).__name__, str(error)]
print("RESULT " + json.dumps(out))
'''


def _run(tmp_path, pythonpath):
    env = {**os.environ, "METAPATCH_DISABLE": "all"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, "-c", FLOW, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_the_series_refuses_rewriting_inits_over_offloaded_layers(tmp_path, tmp_path_factory):
    pytest.importorskip("peft")
    copy = upstream_diff_copy("peft-offload-redispatch", tmp_path_factory)
    assert diffs_for("peft-offload-redispatch")
    upstream = _run(tmp_path, "")
    for init in ("pissa", "olora"):
        assert upstream[init][0] == "RuntimeError" and "set_data" in upstream[init][1], upstream
    with_series = _run(tmp_path, copy)
    for init in ("pissa", "olora"):
        error, message = with_series[init]
        assert error == "ValueError" and "would be lost" in message and "'weight'" in message, with_series
    assert with_series["True"] == ["equal", ""], with_series
