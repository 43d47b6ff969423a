"""peft-offload-redispatch: ``offload_dir`` alone (what peft's own error message tells users to pass)
asks for no new placement, so the base's dispatch is kept as for a plain call: same hook objects,
nothing written to the folder, the offload folder and checkpoint unchanged, in-memory logits.
Without this the call took the full re-dispatch (1.8-2.0 times the in-memory load)."""

from __future__ import annotations

import hashlib
import os

import pytest

import metapatch  # first: the patch under test
from metapatch.patches.peft_offload_redispatch import PATCH
from metapatch.selftest._models import input_ids, save_tiny_llama
from metapatch.selftest._peft import offload_map, save_adapter

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

PATCH_ID = PATCH.id
AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


def _state():
    return {r["id"]: r["state"] for r in metapatch.status()}[PATCH_ID]


def _hashes(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-offload-dir")
    checkpoint = save_tiny_llama(root / "base")
    return checkpoint, save_adapter("llama", checkpoint, root / "adapter", seed=3)


def _hooks(model):
    return {name: module.__dict__["_hf_hook"] for name, module in model.named_modules()
            if "_hf_hook" in module.__dict__}


@pytest.mark.parametrize("extra", [{"offload_dir": "PEFT"}, {"offload_folder": "PEFT"},
                                   {"offload_dir": "PEFT", "is_trainable": True}],
                         ids=["offload_dir", "offload_folder", "offload_dir-trainable"])
def test_offload_dir_alone_keeps_the_base_dispatch(files, tmp_path, extra):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not AFFECTED:
        pytest.skip(f"{PATCH_ID} is not affected here: {WHY}")
    checkpoint, adapter = files
    kwargs = {k: (str(tmp_path / "peft") if v == "PEFT" else v) for k, v in extra.items()}
    ids = input_ids()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), adapter).eval()
    with torch.no_grad():
        want = reference(input_ids=ids).logits

    base = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=offload_map("llama", main="cpu"),
                                                offload_folder=str(tmp_path / "offload"))
    hooks_before = _hooks(base)
    offload_before, checkpoint_before = _hashes(tmp_path / "offload"), _hashes(checkpoint)
    cwd_before = sorted(os.listdir(os.getcwd()))
    model = PeftModel.from_pretrained(base, adapter, **kwargs).eval()
    assert _state() == "applied"

    # The base kept its dispatch: every hook it had is still attached (a LoRA layer's hook moves to
    # its base_layer, so the objects are compared, not the names).
    after = {id(hook) for hook in _hooks(model).values()}
    replaced = [name for name, hook in hooks_before.items() if id(hook) not in after]
    assert not replaced, f"the base's offload hooks were replaced (the full re-dispatch ran): {replaced[:4]}"
    assert not (tmp_path / "peft").exists() or not any((tmp_path / "peft").iterdir())
    assert _hashes(tmp_path / "offload") == offload_before and _hashes(checkpoint) == checkpoint_before
    assert sorted(os.listdir(os.getcwd())) == cwd_before
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.equal(got, want)
    if extra.get("is_trainable"):
        # Trainable: the offloaded layers' adapters still get gradients (they follow their base layer's hook).
        model.train()
        model(input_ids=ids).logits.sum().backward()
        lora = [p for n, p in model.named_parameters() if "lora_" in n and "layers.3." in n]
        assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
