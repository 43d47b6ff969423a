"""empty-built-nonpersistent-buffers and empty-init-nonpersistent-buffers: three-way proof on the
one-process scenarios (subprocesses: unpatched fails, patched equals the model built in memory, the
upstream diff alone fixes it), then in-process checks of what the patches leave alone and how they
refuse. The two-rank scenario is in test_nonpersistent_buffers_ranks.py."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.empty_built_nonpersistent_buffers import PATCH as FROM_PRETRAINED
from metapatch.patches.empty_init_nonpersistent_buffers import PATCH as EMPTY_INIT
from metapatch.selftest import run_scenario, scenarios_for

from _three_way import assert_equals_reference, assert_upstream_error, upstream_diff_copy

PATCHES = {p.id: p for p in (FROM_PRETRAINED, EMPTY_INIT)}
CASES = [s for p in PATCHES for s in scenarios_for(p) if s.name != "fsdp-ranks-buffer"]
GATES = {p.id: metapatch.registry.gate(p) for p in PATCHES.values()}
# what each unpatched failure says (None: the AssertionError of a wrong value, checked by class)
UPSTREAM_MESSAGE = {"include-buffers-dispatch": "is on the meta device, we need a `value`"}
# The accelerate diff cannot see torch's to_empty(): with the diff alone that flow keeps to_empty memory.
DIFF_DOES_LESS = {"to-empty-dispatch"}


def test_scenarios_exist():
    assert {s.name for s in scenarios_for(FROM_PRETRAINED.id)} == {
        "custom-buffer-in-memory", "custom-buffer-offloaded", "fsdp-ranks-buffer"}
    assert {s.name for s in scenarios_for(EMPTY_INIT.id)} == {"include-buffers-dispatch", "to-empty-dispatch"}


def _skip_na(outcome):
    if outcome.not_applicable is not None:
        pytest.skip(f"n/a on this stack: {outcome.not_applicable}")


@pytest.mark.parametrize("scenario", CASES, ids=lambda s: s.key)
def test_unpatched(scenario):
    outcome = run_scenario(scenario, patched=False)
    assert outcome.states[scenario.patch_id] == "disabled"
    _skip_na(outcome)
    affected, why, _, _ = GATES[scenario.patch_id]
    if not affected:
        pytest.skip(f"not affected here: {why}")
    assert_upstream_error(outcome, scenario, why, UPSTREAM_MESSAGE.get(scenario.name))


@pytest.mark.parametrize("scenario", CASES, ids=lambda s: s.key)
def test_patched(scenario):
    outcome = run_scenario(scenario, patched=True)
    _skip_na(outcome)
    assert_equals_reference(outcome)
    if GATES[scenario.patch_id][0]:
        assert outcome.states[scenario.patch_id] == "applied"


@pytest.fixture(scope="module")
def with_diff(tmp_path_factory):
    copies = {}

    def get(patch_id):
        if patch_id not in copies:
            copies[patch_id] = upstream_diff_copy(patch_id, tmp_path_factory)
        return copies[patch_id]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("scenario", CASES, ids=lambda s: s.key)
def test_upstream_diff_alone(scenario, with_diff):
    outcome = run_scenario(scenario, patched=False, pythonpath=[with_diff(scenario.patch_id)])
    _skip_na(outcome)
    if scenario.name in DIFF_DOES_LESS:
        assert not outcome.passed and outcome.error_type == "AssertionError", outcome.traceback
        return
    assert_equals_reference(outcome)


# -- in process (patched): what is left alone, and the refusals ----------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from metapatch import _buffer_rebuild  # noqa: E402
from metapatch.selftest._models import input_ids, nan_sentinel, tiny_llama_config  # noqa: E402
from metapatch.selftest.empty_built_nonpersistent_buffers import register_table_model, save_table_model  # noqa: E402

NEEDS_5 = pytest.mark.skipif(not GATES[FROM_PRETRAINED.id][0], reason="from_pretrained patch not in effect here")


@NEEDS_5
def test_stock_rotary_is_left_to_init_weights(tmp_path, monkeypatch):
    """Stock rotary buffers are written by _init_weights: no rebuild, values equal in memory."""
    from transformers import LlamaForCausalLM

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a model whose _init_weights wrote every buffer was rebuilt")

    monkeypatch.setattr(_buffer_rebuild, "_buffers_by_config", no_rebuild)
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
    _buffer_rebuild._buffers_by_config(loaded, torch.float32)
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


class _Table(torch.nn.Module):
    def __init__(self, dim, base=100.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)


class _Plain(torch.nn.Module):
    def __init__(self, dim, *, base):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim // 2)
        self.table = _Table(dim, base=base)

    def forward(self, x):
        return self.proj(x) * self.table.inv_freq


def _save_plain(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = _Plain(16, base=50.0).eval()
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    return model


def test_plain_module_built_empty_is_refilled_from_its_constructor(tmp_path):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    reference = _save_plain(tmp_path)
    with init_empty_weights(include_buffers=True):
        empty = _Plain(16, base=50.0)
    assert empty.table.inv_freq.is_meta
    assert _buffer_rebuild.CONSTRUCTED[empty] == ((16,), {"base": 50.0})
    assert _buffer_rebuild.CONSTRUCTED[empty.table] == ((16, 50.0), {})
    empty = load_checkpoint_and_dispatch(empty, str(tmp_path / "model.safetensors"),
                                         device_map={"proj": "cpu", "table": "cpu"})
    x = torch.randn(2, 16)
    assert torch.equal(empty.table.inv_freq, reference.table.inv_freq)
    with torch.no_grad():
        assert torch.equal(empty(x), reference(x))


def test_uncaptured_constructor_is_refused_by_name(tmp_path):
    """A meta buffer whose module was built outside init_empty_weights (nothing recorded) and a model
    without a config: MetapatchError naming it, not the raw meta error at dispatch."""
    from accelerate import init_empty_weights, load_checkpoint_in_model

    _save_plain(tmp_path)
    with init_empty_weights(include_buffers=True):
        empty = _Plain(16, base=50.0)
    with torch.device("meta"):
        empty.table = _Table(16, base=50.0)
    assert empty.table not in _buffer_rebuild.CONSTRUCTED
    with pytest.raises(metapatch.MetapatchError, match=r"table\.inv_freq \(_Table\).*not recorded"):
        load_checkpoint_in_model(empty, str(tmp_path / "model.safetensors"), device_map={"proj": "cpu", "table": "cpu"})


def test_to_empty_after_include_buffers_false_is_refilled(tmp_path):
    """transformers#34234: init_empty_weights() keeps buffers real, to_empty() replaces them with
    uninitialised memory, and no checkpoint holds them."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    reference = _save_plain(tmp_path)
    with init_empty_weights():
        empty = _Plain(16, base=50.0)
    assert not empty.table.inv_freq.is_meta
    with nan_sentinel():
        empty.to_empty(device="cpu")
    assert empty.table.inv_freq.isnan().all()
    empty = load_checkpoint_and_dispatch(empty, str(tmp_path / "model.safetensors"), device_map={"": "cpu"})
    assert torch.equal(empty.table.inv_freq, reference.table.inv_freq)


def test_nothing_recorded_for_a_model_built_normally(tmp_path, monkeypatch):
    """No init_empty_weights: to_empty and load_checkpoint_in_model call upstream untouched, and
    nn.Module.__init__ is only wrapped inside the context."""
    from accelerate import init_empty_weights, load_checkpoint_in_model

    _save_plain(tmp_path)
    init = torch.nn.Module.__init__
    model = _Plain(16, base=50.0)
    with init_empty_weights(include_buffers=True):
        assert torch.nn.Module.__init__ is not init
    assert torch.nn.Module.__init__ is init  # restored
    assert model not in _buffer_rebuild.CONSTRUCTED and model.table not in _buffer_rebuild.CONSTRUCTED

    def no_walk(*args, **kwargs):
        raise AssertionError("the patch walked a model not built under init_empty_weights")

    monkeypatch.setattr(_buffer_rebuild, "refill", no_walk)
    monkeypatch.setattr(_buffer_rebuild, "record", no_walk)
    model.to_empty(device="cpu")
    load_checkpoint_in_model(model, str(tmp_path / "model.safetensors"), device_map={"proj": "cpu", "table": "cpu"})


def test_decorated_constructor_is_captured_without_self():
    """transformers 5.17 wraps LlamaRotaryEmbedding.__init__ in a deprecation decorator taking
    (*args, **kwargs): the recorded call is the user's, without the module itself."""
    import functools

    from accelerate import init_empty_weights

    def passthrough(init):
        @functools.wraps(init)
        def wrapped(*args, **kwargs):
            return init(*args, **kwargs)
        return wrapped

    class Decorated(_Table):
        @passthrough
        def __init__(self, dim, base=100.0):
            super().__init__(dim, base=base)

    with init_empty_weights(include_buffers=True):
        module = Decorated(16, base=7.0)
    assert _buffer_rebuild.CONSTRUCTED[module] == ((16,), {"base": 7.0})
    assert torch.equal(_buffer_rebuild._buffers_by_constructor(module, None)["inv_freq"], _Table(16, base=7.0).inv_freq)
