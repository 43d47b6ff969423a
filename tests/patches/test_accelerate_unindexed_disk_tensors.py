"""accelerate-unindexed-disk-tensors: three-way proof on MarianMT with its never-saved sinusoidal table on
disk and on a new classification head loaded over a base checkpoint (subprocesses, real from_pretrained with
disk offload), and in-process checks on real
``from_pretrained(device_map=..., offload_folder=...)``: a missing tensor drawn at random is served as the
in-memory model drew it, the offload folder and the working directory are left as they were, and nothing
is looked at where no disk-mapped tensor is missing from the index."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import metapatch
from metapatch.patches.accelerate_unindexed_disk_tensors import PATCH, unindexed

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

torch = pytest.importorskip("torch")
AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


def test_affected_on_every_supported_accelerate():
    assert AFFECTED, WHY


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"never-saved-table-on-disk", "new-head-from-base-checkpoint-on-disk"}}


def _random_extra_model_class():
    """A model whose ``extra`` layer is missing from its checkpoint and drawn at random at every load."""
    transformers = pytest.importorskip("transformers")

    class Config(transformers.PretrainedConfig):
        model_type = "metapatch-random-extra"

    class Model(transformers.PreTrainedModel):
        config_class = Config
        _keys_to_ignore_on_save = ["extra.weight"]
        _no_split_modules: list = []

        def __init__(self, config):
            super().__init__(config)
            self.body = torch.nn.Linear(4, 4)
            self.extra = torch.nn.Linear(4, 4, bias=False)
            self.post_init()

        def _init_weights(self, module):
            if module is self.extra:
                torch.nn.init.normal_(module.weight)

        def forward(self, x):
            return self.extra(self.body(x))

    return Model, Config


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.skipif(not AFFECTED, reason=WHY)
def test_a_missing_tensor_drawn_at_random_is_served_as_the_in_memory_model_drew_it(tmp_path):
    """transformers draws a tensor missing from the checkpoint at load; from the same random state the
    in-memory load draws the same value, and that is what the disk-offloaded model now computes with (upstream:
    KeyError). The offload folder is not written after the load, nor anything in the working directory."""
    Model, Config = _random_extra_model_class()
    Model(Config()).save_pretrained(tmp_path / "ckpt")
    x = torch.ones(1, 4)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = Model.from_pretrained(tmp_path / "ckpt")(x)
    torch.manual_seed(7)
    offload, cwd = tmp_path / "offload", os.listdir(os.getcwd())
    model = Model.from_pretrained(tmp_path / "ckpt", device_map={"body": "cpu", "extra": "disk"},
                                  offload_folder=str(offload))
    assert model.extra.weight.is_meta  # on disk, as the map says
    written = _digest(offload)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)
    assert _digest(offload) == written
    assert os.listdir(os.getcwd()) == cwd
    torch.manual_seed(8)
    with torch.no_grad():  # another draw gives another model: the test can tell the two apart
        assert not torch.equal(Model.from_pretrained(tmp_path / "ckpt")(x), expected)


def test_nothing_is_looked_at_without_a_disk_entry_or_an_index():
    class Exploding(torch.nn.Module):
        def named_parameters(self, *args, **kwargs):
            raise AssertionError("walked")

        def state_dict(self, *args, **kwargs):
            raise AssertionError("walked")

    model = Exploding()
    assert unindexed(model, {"": "cpu"}, {}) == {}
    assert unindexed(model, {"": "disk"}, None) == {}
    assert unindexed(model, "auto", {}) == {}


def test_only_disk_mapped_real_tensors_missing_from_the_index_are_taken():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.device("meta"):
        model[2].weight = torch.nn.Parameter(torch.empty(2, 2))
    found = unindexed(model, {"0": "cpu", "1": "disk", "2": "disk"}, {"1.bias": {}})
    assert set(found) == {"1.weight", "2.bias"}  # 0 is not on disk, 1.bias is indexed, 2.weight is meta
    assert found["1.weight"] is model[1].weight  # a reference, not a copy


def test_no_module_serialises_itself_to_be_looked_at():
    """A module's own _save_to_state_dict (bitsandbytes' 4-bit layers) would run on meta tensors: the
    lookup reads tensors as the hooks do, without state_dict()."""
    class Refusing(torch.nn.Linear):
        def _save_to_state_dict(self, *args, **kwargs):
            raise AssertionError("serialised")

    model = torch.nn.Sequential(Refusing(2, 2), torch.nn.Linear(2, 2))
    assert set(unindexed(model, {"0": "disk", "1": "cpu"}, {"0.weight": {}})) == {"0.bias"}
