"""A tied output head *with a bias* beside an input embedding on disk (found by ``metapatch sweep``,
placement first-on-disk): BertLMHeadModel, BigBirdForCausalLM, CTRLLMHeadModel, Data2VecTextForCausalLM.

The explicit-map repair (tied-device-map-transformers, metapatch._offload.tied_placement.Placement) used to move
only the tied parameter (``cls.predictions.decoder.weight: disk`` beside ``...decoder.bias: cpu``);
accelerate hooks modules, so the weight stayed on meta with no hook and the head computed on the
placeholder (garbage logits, later refused by offloaded-outside-reads). A leaf module now moves whole:
the loaded model equals the in-memory one. Upstream refuses the map (``weight is on the meta device``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from metapatch._offload.tied_members import tied_groups
from metapatch._offload.tied_placement import Placement

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CLASSES = ("BertLMHeadModel", "BigBirdForCausalLM", "CTRLLMHeadModel", "Data2VecTextForCausalLM")
REPO = Path(__file__).resolve().parents[2]


def _save(name: str, folder: Path):
    from metapatch.sweep import placements, shrink

    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config = shrink.tiny_config(cls.config_class)
    config.is_decoder = True
    torch.manual_seed(0)
    cls(config).save_pretrained(folder)
    reference = cls.from_pretrained(folder).eval()
    top, layers = placements.units(reference)
    return cls, reference, placements.device_map("first-on-disk", top, layers, "cpu")


@pytest.mark.parametrize("name", CLASSES)
def test_tied_head_with_bias_beside_an_embedding_on_disk_equals_in_memory(name, tmp_path):
    cls, reference, device_map = _save(name, tmp_path / "ckpt")
    before = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").iterdir()}
    model = cls.from_pretrained(tmp_path / "ckpt", device_map=device_map,
                                offload_folder=str(tmp_path / "offload")).eval()
    placed = model.hf_device_map
    # No leaf module of the head is split into parameter keys.
    for key in placed:
        owner, _, leaf = key.rpartition(".")
        assert not (leaf in ("weight", "bias") and not list(model.get_submodule(owner).children())), placed
    ids = torch.randint(4, 60, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids.to(model.device)).logits, reference(ids).logits)
    assert {p.name: p.stat().st_size for p in (tmp_path / "ckpt").iterdir()} == before
    assert Path.cwd() != tmp_path


def test_unpatched_refuses_the_map(tmp_path):
    """The reproducer is real: without metapatch, the same load fails (or is wrong)."""
    _, _, device_map = _save("BertLMHeadModel", tmp_path / "ckpt")
    code = (
        "import sys, torch, transformers\n"
        "from metapatch.sweep import shrink\n"
        f"m = transformers.BertLMHeadModel.from_pretrained({str(tmp_path / 'ckpt')!r}, device_map={device_map!r},"
        f" offload_folder={str(tmp_path / 'off')!r}).eval()\n"
        "r = transformers.BertLMHeadModel.from_pretrained(" + repr(str(tmp_path / 'ckpt')) + ").eval()\n"
        "ids = torch.randint(4, 60, (1, 8), generator=torch.Generator().manual_seed(1))\n"
        "with torch.no_grad():\n"
        "    print('EQUAL' if torch.equal(m(ids).logits, r(ids).logits) else 'WRONG')\n")
    env = dict(os.environ, METAPATCH_DISABLE="all", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert "EQUAL" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.returncode != 0 or "WRONG" in done.stdout


def test_placement_moves_a_leaf_module_whole():
    """Pure map repair: the tied head (weight tied to the embedding, plus its own bias) follows the
    embedding to disk as one module entry, not as ``head.weight: disk`` beside ``head.bias: cpu``."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 8)
            self.head.weight = self.embed.weight

    model = Model()
    groups = tied_groups(model)
    assert groups == [("embed.weight", "head.weight")]
    placement = Placement(model, {"embed": "disk", "body": "cpu", "head": "cpu"}, groups,
                             devices=["cpu", "disk"])
    assert placement.repair() == {"embed": "disk", "body": "cpu", "head": "disk"}
    assert placement.moves == [("head.weight", "embed.weight", "cpu", "disk")]


def test_camembert_whose_first_parameter_is_a_tied_source_beside_an_embedding_on_disk(tmp_path):
    """CamembertForCausalLM builds ``lm_head`` before ``roberta``: its first parameter is ``lm_head.bias``,
    the source of ``lm_head.decoder.bias``, which no accelerate hook loads (the decoder's hook loads it
    under the decoder's name). ``model.device`` said meta, the inputs went to meta and the first hook
    raised "Cannot copy out of meta tensor" (the sweep's first-on-disk, in transformers' own idiom:
    inputs sent to ``model.device``). offloaded-model-device now answers the device where the first
    parameter that has a place is used."""
    from transformers import CONFIG_MAPPING

    from metapatch.sweep import child, placements, shrink

    cls = getattr(transformers, "CamembertForCausalLM", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no CamembertForCausalLM")
    torch.manual_seed(0)
    cls(shrink.tiny_config(CONFIG_MAPPING["camembert"])).eval().save_pretrained(tmp_path / "ckpt")
    reference_model = cls.from_pretrained(tmp_path / "ckpt").eval()
    assert next(reference_model.named_parameters())[0] == "lm_head.bias"  # what makes this case
    inputs = child._inputs(reference_model)
    reference = {"logits": child._logits(reference_model, inputs), "tokens": child._generate(reference_model, inputs)}
    top, layers = placements.units(reference_model)
    device_map = placements.device_map("first-on-disk", top, layers, "cpu")
    model = cls.from_pretrained(tmp_path / "ckpt", device_map=device_map, offload_folder=str(tmp_path / "off")).eval()
    assert next(model.parameters()).is_meta and model.device == torch.device("cpu")
    assert torch.equal(child._logits(model, inputs), reference["logits"])
    assert torch.equal(child._generate(model, inputs), reference["tokens"])
