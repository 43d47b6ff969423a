"""peft-offload-redispatch: a second placement asked for at the PEFT call (``device_map=...``,
``device_map="sequential"``) over an offloaded base; ``device_map="auto"`` alone is upstream's default and
keeps the base's dispatch, as passing nothing does. Where it equals the base's placement the base keeps
its dispatch (the same hook objects, as for a plain call); where it differs only the map entries
whose tensors move are unhooked and moved, the others keep their hooks. Always: the in-memory
model's logits, the base's offload folder and checkpoint unchanged, nothing written outside the
``offload_dir`` named at the call (and there only tensors newly sent to disk).

The maps and budgets here name ``cpu`` and ``disk`` only, so every model computes on the CPU whatever
the machine has (the same flows with GPU 0 in the map are the selftest scenarios' ``max-memory-*`` kinds,
which run on the execution device)."""

from __future__ import annotations

import hashlib
import os
import re

import pytest

import metapatch  # first: the patch under test
from metapatch.patches.peft_offload_redispatch import PATCH
from metapatch.selftest._models import input_ids, save_tiny_llama
from metapatch.selftest._peft import offload_map, save_adapter

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


def _hashes(folder):
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _layer(name):
    found = re.search(r"model\.layers\.\d+", name)
    return found.group(0) if found else name


def _hooks(model):
    return {name: module.__dict__["_hf_hook"] for name, module in model.named_modules()
            if "_hf_hook" in module.__dict__}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-second-placement")
    checkpoint = save_tiny_llama(root / "base")
    adapter = save_adapter("llama", checkpoint, root / "adapter", seed=3)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), adapter).eval()
    with torch.no_grad():
        want = reference(input_ids=input_ids()).logits
    return checkpoint, adapter, want


def _moved_map():
    """Layer 2 comes back from disk into memory, layer 1 goes from memory to disk: a real move both ways."""
    device_map = offload_map("llama", main="cpu")
    device_map["model.layers.1"], device_map["model.layers.2"] = "disk", "cpu"
    return device_map


CASES = {
    # the base's own map, passed again: nothing moves
    "same-map": (lambda: offload_map("llama", main="cpu"), set(), {}),
    # upstream's own default (load_adapter reads kwargs.get("device_map", "auto")): the same call as
    # passing nothing, so the base keeps its dispatch
    "auto": (lambda: "auto", set(), {}),
    # "auto" with a budget is a request: the budget holds the whole model, so the disk layers move
    "auto-max-memory": (lambda: "auto", {"model.layers.2", "model.layers.3"}, {"max_memory": {"cpu": 10 ** 10}}),
    # a strategy asked for, with a cpu budget that holds the whole model (without one, a GPU machine's
    # "sequential" fills GPU 0 first): the disk layers move and the others stay hooked
    "sequential": (lambda: "sequential", {"model.layers.2", "model.layers.3"}, {"max_memory": {"cpu": 10 ** 10}}),
    "moved-map": (_moved_map, {"model.layers.1", "model.layers.2"}, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_second_placement_moves_only_what_moves(files, tmp_path, case):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not AFFECTED:
        pytest.skip(f"{PATCH.id} is not affected here: {WHY}")
    checkpoint, adapter, want = files
    make_map, moving, extra = CASES[case]
    base = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=offload_map("llama", main="cpu"),
                                                offload_folder=str(tmp_path / "offload"))
    hooks_before = _hooks(base)
    offload_before, checkpoint_before = _hashes(tmp_path / "offload"), _hashes(checkpoint)
    cwd_before = sorted(os.listdir(os.getcwd()))

    model = PeftModel.from_pretrained(base, adapter, device_map=make_map(),
                                      offload_dir=str(tmp_path / "peft"), **extra).eval()

    after = {id(hook) for hook in _hooks(model).values()}
    replaced = {_layer(name) for name, hook in hooks_before.items() if id(hook) not in after}
    assert replaced == moving, f"hooks replaced under {sorted(replaced)}; expected only under {sorted(moving)}"
    assert _hashes(tmp_path / "offload") == offload_before and _hashes(checkpoint) == checkpoint_before
    assert sorted(os.listdir(os.getcwd())) == cwd_before
    written = _hashes(tmp_path / "peft")
    if case == "moved-map":
        # Only the tensors newly sent to disk (layer 1's) are written, and only to offload_dir.
        names = {n.rsplit(".", 1)[0] for n in written if n.endswith(".dat")}
        assert names and all(".layers.1." in n for n in names), sorted(names)
    else:
        assert not written
    with torch.no_grad():
        got = model(input_ids=input_ids()).logits
    assert torch.equal(got, want)
    if moving == {"model.layers.2", "model.layers.3"}:  # everything in memory now
        assert not any(p.device.type == "meta" for p in model.parameters())
