"""empty-init-nonpersistent-buffers: three-way proof on the one-process scenarios (subprocesses:
unpatched fails, patched equals the model built in memory, the upstream diff alone fixes what it
can), then in-process checks of what the patch leaves alone and how it refuses."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.empty_init_nonpersistent_buffers import PATCH as EMPTY_INIT

from _three_way import ThreeWayCase, explain  # tests/patches/_three_way.py

# The accelerate diff cannot see torch's to_empty(): with the diff alone those flows keep to_empty memory.
DIFF_DOES_LESS = {"to-empty-dispatch", "to-empty-load-state-dict", "meta-device-to-empty"}


class TestThreeWay(ThreeWayCase):
    patch_ids = (EMPTY_INIT.id,)
    names = {EMPTY_INIT.id: {"include-buffers-dispatch", "to-empty-dispatch", "to-empty-load-state-dict",
                             "meta-device-to-empty"}}

    @pytest.mark.slow
    def test_upstream_diff_alone(self, runs, scenario):
        if scenario.name not in DIFF_DOES_LESS:
            super().test_upstream_diff_alone(runs, scenario)
            return
        outcome = runs.get(scenario, "diff")
        self._applies(scenario, outcome)
        assert not outcome.passed and outcome.error_type == "AssertionError", explain(outcome)


# -- in process (patched): what is left alone, and the refusals ----------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from metapatch._offload import buffer_rebuild  # noqa: E402
from metapatch.selftest._models import nan_sentinel  # noqa: E402


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
    assert buffer_rebuild.CONSTRUCTED[empty] == ((16,), {"base": 50.0})
    assert buffer_rebuild.CONSTRUCTED[empty.table] == ((16, 50.0), {})
    empty = load_checkpoint_and_dispatch(empty, str(tmp_path / "model.safetensors"),
                                         device_map={"proj": "cpu", "table": "cpu"})
    x = torch.randn(2, 16)
    assert torch.equal(empty.table.inv_freq, reference.table.inv_freq)
    with torch.no_grad():
        assert torch.equal(empty(x), reference(x))


@pytest.mark.parametrize("device_map, expected", [
    ({"": 0}, "cuda:0"), ({"proj": 1, "table": 0}, "cuda:0"), ({"proj": "cpu", "table": "disk"}, "cpu"),
    ({"table.inv_freq": "cuda:1", "": "cpu"}, "cuda:1"), (None, "cpu"), ("auto", "cpu")])
def test_a_buffer_left_on_meta_is_rebuilt_where_the_map_puts_it(device_map, expected):
    """load_checkpoint_in_model without a dispatch: the in-memory model holds the buffer where the map puts its module
    (a GPU index is that GPU; cpu and disk entries, or no map, are the CPU)."""
    assert str(buffer_rebuild._mapped_device(device_map, "table.inv_freq")) == expected


@pytest.mark.gpu(count=1)
def test_a_buffer_left_on_meta_goes_to_gpu_0_with_its_module(tmp_path):
    from accelerate import init_empty_weights, load_checkpoint_in_model

    reference = _save_plain(tmp_path).to(0)
    with init_empty_weights(include_buffers=True):
        empty = _Plain(16, base=50.0)
    load_checkpoint_in_model(empty, str(tmp_path / "model.safetensors"), device_map={"": 0})
    assert empty.table.inv_freq.device == torch.device("cuda:0")
    x = torch.randn(2, 16, device=0)
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
    assert empty.table not in buffer_rebuild.CONSTRUCTED
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
    assert torch.equal(empty.table.inv_freq, reference.table.inv_freq)  # refilled by to_empty itself
    empty = load_checkpoint_and_dispatch(empty, str(tmp_path / "model.safetensors"), device_map={"": "cpu"})
    assert torch.equal(empty.table.inv_freq, reference.table.inv_freq)


def test_to_empty_keeps_a_real_buffer_set_after_construction():
    """init_empty_weights() keeps buffers real: a non-persistent buffer given its value after construction (a
    scaled rotary table, a temperature) keeps that value through to_empty(), not its constructor's (what an
    in-memory model built the same way and moved with .to() holds). Upstream leaves to_empty memory."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    rotary = model.model.rotary_emb
    assert not rotary.inv_freq.is_meta and "inv_freq" in rotary._non_persistent_buffers_set
    with torch.no_grad():
        rotary.inv_freq.mul_(1.5)  # e.g. a context-extension scale applied by hand
    want = rotary.inv_freq.clone()
    constructed = LlamaForCausalLM(config).model.rotary_emb.inv_freq
    assert not torch.equal(want, constructed)  # the two answers differ: the test can tell them apart
    with nan_sentinel():
        model.to_empty(device="cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, want)


def test_to_empty_keeps_real_buffers_and_rebuilds_only_the_meta_ones():
    """A plain module built with include_buffers=True whose one table was then set to a real value: that table
    keeps its value, the other (still on meta) gets its constructor's."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        model = _Plain(16, base=50.0)
        model.other = _Table(16, base=30.0)
    set_value = torch.linspace(0.0, 1.0, 8)
    model.table.inv_freq = set_value.clone()  # real, set after construction (a buffer assignment)
    assert model.other.inv_freq.is_meta
    with nan_sentinel():
        model.to_empty(device="cpu")
    assert torch.equal(model.table.inv_freq, set_value)
    assert torch.equal(model.other.inv_freq, _Table(16, base=30.0).inv_freq)


def test_to_empty_keeps_what_it_cannot_recompute_for_the_load_to_refuse(tmp_path):
    """A buffer whose constructor cannot be run again: to_empty() does not raise (the user may set it), and
    load_checkpoint_in_model refuses it by name, as before."""
    from accelerate import init_empty_weights, load_checkpoint_in_model

    _save_plain(tmp_path)
    with init_empty_weights(include_buffers=True):  # on meta: no value to keep, only a constructor to run again
        empty = _Plain(16, base=50.0)
    buffer_rebuild.CONSTRUCTED.pop(empty.table, None)  # as if its constructor had not been recorded
    empty.__dict__.pop("config", None)
    with nan_sentinel():
        empty.to_empty(device="cpu")
    assert empty.table.inv_freq.isnan().all()
    with pytest.raises(metapatch.MetapatchError, match=r"table\.inv_freq \(_Table\)"):
        load_checkpoint_in_model(empty, str(tmp_path / "model.safetensors"), device_map={"proj": "cpu", "table": "cpu"})


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
    assert model not in buffer_rebuild.CONSTRUCTED and model.table not in buffer_rebuild.CONSTRUCTED

    def no_walk(*args, **kwargs):
        raise AssertionError("the patch walked a model not built under init_empty_weights")

    monkeypatch.setattr(buffer_rebuild, "refill", no_walk)
    monkeypatch.setattr(buffer_rebuild, "record", no_walk)
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
    assert buffer_rebuild.CONSTRUCTED[module] == ((16,), {"base": 7.0})
    assert torch.equal(buffer_rebuild._buffers_by_constructor(module, None)["inv_freq"], _Table(16, base=7.0).inv_freq)


def test_a_plain_module_built_on_meta_is_left_as_torch_leaves_it():
    """Built under torch.device("meta") without a transformers config: nothing can recompute its table, and
    to_empty() neither raises nor records it (a later load_checkpoint_in_model is upstream's, untouched)."""
    from metapatch.patches import empty_init_nonpersistent_buffers as patch

    with torch.device("meta"):
        model = _Plain(16, base=50.0)
    with nan_sentinel():
        model.to_empty(device="cpu")
    assert model.table.inv_freq.isnan().all() and model not in patch._EMPTIED


def test_a_transformers_model_built_on_meta_gets_its_table_back_at_to_empty():
    """No constructor recorded (torch's meta device, not init_empty_weights): the model's config rebuilds the
    rotary table that to_empty() turned into uninitialised memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    reference = LlamaForCausalLM(config).model.rotary_emb.inv_freq
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with nan_sentinel():
        model.to_empty(device="cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, reference)
