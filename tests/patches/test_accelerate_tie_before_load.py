"""accelerate-tie-before-load: three-way proof on a tied Llama built under init_empty_weights and loaded with
load_checkpoint_and_dispatch ("auto" and a cpu+disk map) or load_checkpoint_in_model (subprocesses), plus
in-process checks of when the wrapper ties and when it must not.

Measured unpatched (ValueError "weight is on the meta device, we need a `value` to put in on cpu." with the
explicit maps; NotImplementedError "Cannot copy out of meta tensor" with "auto"): accelerate 1.10.1 /
transformers 4.57.6, 1.13.0 / 5.11.0, 1.15.0 / 5.24.0."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.accelerate_tie_before_load import PATCH, tie_if_declared, untied_declared_ties

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"dispatch-cpu-disk-map", "dispatch-auto", "load-checkpoint-in-model",
                        "untied-models-unchanged"}}

    def check_unpatched(self, scenario, outcome):
        if outcome.passed:
            assert outcome.metrics["head_tied"] is False

    def check_patched(self, scenario, outcome):
        # tied exactly where the model declares it
        assert outcome.metrics["head_tied"] is bool(scenario.expected_error)


# -- in-process: when the wrapper ties, and when it leaves the model alone -------------------------

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
needs_patch = pytest.mark.skipif(not AFFECTED, reason=f"patch not active here: {WHY}")


def _empty_llama(tie: bool):
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import tiny_llama_config

    with init_empty_weights():
        return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, tie_word_embeddings=tie))


def test_declared_ties_of_an_empty_model():
    model = _empty_llama(tie=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # the bug's precondition
    assert untied_declared_ties(model) == [("lm_head.weight", "model.embed_tokens.weight")]
    assert tie_if_declared(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert untied_declared_ties(model) == [] and not tie_if_declared(model)  # already tied: nothing to do


def test_models_left_alone():
    untied = _empty_llama(tie=False)
    assert untied_declared_ties(untied) == [] and not tie_if_declared(untied)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight

    # materialised, then untied on purpose by its user: not an empty build, so not ours to re-tie
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, tie_word_embeddings=True))
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert untied_declared_ties(model) == [] and not tie_if_declared(model)

    # a plain module has no tie_weights: nothing to call
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"))
    assert not tie_if_declared(plain)


@needs_patch
def test_wrapper_is_installed_on_every_alias():
    import accelerate.big_modeling
    import accelerate.utils
    import accelerate.utils.modeling

    for module, name in ((accelerate, "load_checkpoint_and_dispatch"), (accelerate, "load_checkpoint_in_model"),
                         (accelerate.utils, "load_checkpoint_in_model"),
                         (accelerate.big_modeling, "load_checkpoint_in_model")):
        assert hasattr(getattr(module, name), "_self_metapatch"), f"{module.__name__}.{name} is not wrapped"


@needs_patch
def test_load_checkpoint_in_model_ties_in_process(tmp_path):
    from accelerate.utils import load_checkpoint_in_model
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import input_ids, tiny_llama_config

    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, tie_word_embeddings=True)).eval()
    reference.save_pretrained(tmp_path)
    model = _empty_llama(tie=True)
    load_checkpoint_in_model(model, str(tmp_path), device_map={"": "cpu"})
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids()).logits, reference(input_ids()).logits)


_LAYERS = {"model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.norm": "cpu"}


def _digests(folder):
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@needs_patch
@pytest.mark.parametrize("embed, head", [("disk", "disk"), ("cpu", "disk"), ("disk", "cpu")])
def test_load_checkpoint_and_dispatch_tied_pair_on_disk_or_split(tmp_path, monkeypatch, embed, head):
    """A tied pair on disk (upstream: KeyError 'lm_head.weight' at the first forward) or split across
    cpu/disk (KeyError, or 'weight is on the meta device, we need a `value`') loads as from_pretrained does:
    the logits and greedy tokens of the in-memory model; only the named offload folder is written to."""
    from accelerate import load_checkpoint_and_dispatch
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import input_ids, tiny_llama_config

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, tie_word_embeddings=True)).eval()
    reference.save_pretrained(tmp_path / "ckpt")
    checkpoint = _digests(tmp_path / "ckpt")
    listing = sorted(p.name for p in tmp_path.iterdir())
    model = load_checkpoint_and_dispatch(
        _empty_llama(tie=True), str(tmp_path / "ckpt"), offload_folder=str(tmp_path / "offload"),
        device_map={**_LAYERS, "model.embed_tokens": embed, "lm_head": head}).eval()
    assert model.model.embed_tokens.weight.is_meta is (embed == "disk")
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                       reference.generate(ids, max_new_tokens=4, do_sample=False))
    assert _digests(tmp_path / "ckpt") == checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(listing + ["offload"])


def test_tied_copies_left_alone_without_a_disk_entry(tmp_path):
    """The post-load completion costs nothing where no tied copy can be missing: no disk entry in the map."""
    from metapatch.patches import accelerate_tie_before_load as patch_module

    model = _empty_llama(tie=True)
    patch_module._complete_tied_copies(model, {"": "cpu"}, str(tmp_path / "never"))
    patch_module._complete_tied_copies(model, "auto", None)
    assert not (tmp_path / "never").exists() and model.lm_head.weight.is_meta
