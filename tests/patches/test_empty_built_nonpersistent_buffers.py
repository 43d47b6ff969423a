"""empty-built-nonpersistent-buffers: three-way proof on the one-process scenarios (subprocesses:
unpatched fails, patched equals the model built in memory, the upstream diff alone fixes it), the
same on two real ranks (gloo on CPU, FSDP cpu_ram_efficient_loading: rank 0 gets empty_like memory and
ranks != 0 zeros_like for a buffer _init_weights does not recompute; fsdp-rank-placeholders then
broadcasts rank 0's copy; marked ``ranks`` and ``slow``), then in-process checks of what the patch
leaves alone and how it refuses."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.empty_built_nonpersistent_buffers import PATCH as FROM_PRETRAINED

from _three_way import ThreeWayCase, assert_equals_reference, explain  # tests/patches/_three_way.py

GATES = {FROM_PRETRAINED.id: metapatch.registry.gate(FROM_PRETRAINED)}
RANKS = "fsdp-ranks-buffer"


class TestThreeWay(ThreeWayCase):
    patch_ids = (FROM_PRETRAINED.id,)
    names = {FROM_PRETRAINED.id: {"custom-buffer-in-memory", "custom-buffer-offloaded", RANKS}}

    @classmethod
    def scenarios(cls):
        return [s for s in super().scenarios() if s.name != RANKS]  # TestRanks

    @pytest.mark.slow
    def test_upstream_diff_alone(self, runs, scenario):
        super().test_upstream_diff_alone(runs, scenario)


@pytest.mark.ranks
@pytest.mark.slow  # two interpreters per leg
class TestRanks(ThreeWayCase):
    patch_ids = (FROM_PRETRAINED.id,)

    @classmethod
    def scenarios(cls):
        return [s for s in super().scenarios() if s.name == RANKS]

    def check_unpatched(self, scenario, outcome):
        # rank 0: empty_like (NaN sentinel) memory; rank 1: zeros_like; neither is the constructor's value
        assert "'rank0_loaded_equal': False" in outcome.error and "'rank1_loaded_equal': False" in outcome.error

    def check_patched(self, scenario, outcome):
        assert all(outcome.metrics[f"rank{r}_{k}_equal"] for r in (0, 1) for k in ("loaded", "prepared", "logits"))

    def test_upstream_diff_alone(self, runs, scenario):
        from importlib.metadata import version

        from packaging.version import Version

        why = self.diff_skip(scenario)
        if why:
            pytest.skip(f"diff leg does not apply: {why}")
        outcome = runs.get(scenario, "diff")
        self._applies(scenario, outcome)
        if outcome.passed or Version(version("transformers")) >= Version("5.23"):
            assert_equals_reference(outcome, scenario.tolerance)
            return
        # transformers < 5.23 gives rank 1 zeros for every weight until an FSDP prepare; the evaluation-only
        # prepare does not broadcast them upstream (fsdp-rank-placeholders' accelerate diff, not this one).
        # The buffers themselves must still be right on every rank.
        assert outcome.error_type == "AssertionError", explain(outcome)
        for rank in (0, 1):
            for key in ("loaded", "prepared"):
                assert f"'rank{rank}_{key}_equal': True" in outcome.error, outcome.error
        assert "'rank0_logits_equal': True" in outcome.error, outcome.error


# -- in process (patched): what is left alone, and the refusals ----------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from metapatch._offload import buffer_rebuild  # noqa: E402
from metapatch.selftest._models import input_ids, nan_sentinel, tiny_llama_config  # noqa: E402
from metapatch.selftest.empty_built_nonpersistent_buffers import register_table_model, save_table_model  # noqa: E402

NEEDS_5 = pytest.mark.skipif(not GATES[FROM_PRETRAINED.id][0], reason="from_pretrained patch not in effect here")


@NEEDS_5
def test_stock_rotary_is_left_to_init_weights(tmp_path, monkeypatch):
    """Stock rotary buffers are written by _init_weights: no rebuild, values equal in memory."""
    from transformers import LlamaForCausalLM

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a model whose _init_weights wrote every buffer was rebuilt")

    monkeypatch.setattr(buffer_rebuild, "_buffers_by_config", no_rebuild)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1)).eval()
    model.save_pretrained(tmp_path)
    with nan_sentinel():
        loaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids()).logits, model(input_ids()).logits)


@NEEDS_5
def test_refill_keeps_the_buffer_object_and_random_state(tmp_path):
    reference = save_table_model(tmp_path)
    cls = register_table_model()
    with nan_sentinel():
        loaded = cls.from_pretrained(tmp_path)
    buffer = loaded.block.rope.inv_freq
    assert torch.equal(buffer, reference.block.rope.inv_freq)
    assert buffer.data_ptr() and loaded.block.rope._buffers["inv_freq"] is buffer
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    buffer_rebuild._buffers_by_config(loaded, torch.float32)
    assert torch.equal(torch.random.get_rng_state(), state)  # the rebuild draws nothing from the user's stream


@NEEDS_5
def test_unrecomputable_buffer_is_refused_by_name(tmp_path):
    """A model that its config alone cannot rebuild (an extra constructor argument) gets a
    MetapatchError naming the buffer and its module, never the empty_like memory."""
    from torch import nn
    from transformers import PreTrainedModel

    base = register_table_model()

    class Scaled(PreTrainedModel):
        config_class = base.config_class

        def __init__(self, config, scale):
            super().__init__(config)
            self.head = nn.Linear(config.hidden_size, config.hidden_size)
            self.register_buffer("scales", torch.arange(config.hidden_size) * scale, persistent=False)
            self.post_init()

    Scaled(base.config_class(), scale=2.0).save_pretrained(tmp_path)
    with nan_sentinel(), pytest.raises(metapatch.MetapatchError, match=r"scales \(Scaled\).*TypeError"):
        Scaled.from_pretrained(tmp_path, scale=2.0)
