"""bnb-cpu-repack-copy, in process: a write into an in-memory 4-bit weight after an evaluation is what the next
forward computes with. The repacked copy is kept while the weight's ``_version`` stays; a write through torch's
``.data`` (a version counter of its own) used to leave it stale, so the forward computed with the bytes from before
the write (``weight.data.zero_()`` after one ``no_grad`` forward: unchanged logits; upstream, repacking in place,
sees the write).

The oracle is the same model written before its first forward (the layer keeps its portable layout here, as on a
GPU; upstream's in-place repack makes the same byte offsets address another layout after a forward, so only a
write that means the same in both layouts, zeroing the whole weight, is compared with upstream: see
tests/patches/test_bnb_cpu_repack_copy.py for the three-way scenarios). The execution device is a parameter
(``cuda:0`` where CUDA is present: no CPU kernel, nothing repacked, the same equalities); each test says which
path ran on the CPU (whether bitsandbytes repacks here)."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.bnb_cpu_repack_copy import PATCH

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)
pytestmark = pytest.mark.skipif(not AFFECTED, reason=f"{PATCH.id} not in range here: {WHY}")
DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
LAYER = "model.layers.1.mlp.down_proj"

WRITES = {
    "data-zero": lambda w: w.data.zero_(),
    "data-rows": lambda w: w.data[0:512].fill_(0),
    "data-copy": lambda w: w.data.copy_((torch.arange(w.numel()) * 37 % 256).to(w.dtype).reshape(w.shape)),
    "rows-under-no-grad": lambda w: w.__setitem__(slice(0, 512), 0),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from metapatch.selftest.transformers_quantized_disk_weights import checkpoint as tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("repack-writes"))


def _load(checkpoint, device):
    from metapatch.selftest import transformers_quantized_disk_weights as quantized

    return quantized.load(checkpoint, quantized.quant_config(fp32_cpu_offload=False),
                          {"": 0 if device.startswith("cuda") else "cpu"})


def _logits(model):
    from metapatch.selftest._models import input_ids

    with torch.no_grad():
        return model(input_ids().to(model.device)).logits.float().cpu()


def _write(model, kind):
    with torch.no_grad():
        WRITES[kind](model.get_submodule(LAYER).weight)


def _repacks_here(model, device):
    layer = model.get_submodule(LAYER)
    return device == "cpu" and bool(getattr(layer, "support_avx512bf16_for_cpu", False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(WRITES))
def test_a_write_after_an_evaluation_is_what_the_next_forward_computes_with(checkpoint, device, kind):
    written_first = _load(checkpoint, device)
    _write(written_first, kind)
    expected = _logits(written_first)

    model = _load(checkpoint, device)
    untouched = _logits(model)
    assert not torch.equal(expected, untouched), "the write changed nothing: the comparison would be vacuous"
    weight = model.get_submodule(LAYER).weight
    # which path ran: a repacked copy (its weight watched for writes) exactly where bitsandbytes repacks
    assert (type(weight) is not bnb.nn.Params4bit) == _repacks_here(model, device), type(weight)
    assert type(weight).__name__ == "Params4bit" and isinstance(weight, bnb.nn.Params4bit)
    _write(model, kind)
    assert torch.equal(_logits(model), expected)
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_data_alias_taken_after_an_evaluation_writes_what_the_next_forward_computes_with(checkpoint, device):
    written_first = _load(checkpoint, device)
    _write(written_first, "data-zero")
    expected = _logits(written_first)

    model = _load(checkpoint, device)
    _logits(model)
    alias = model.get_submodule(LAYER).weight.data
    _logits(model)
    alias.zero_()
    assert torch.equal(_logits(model), expected)


def test_a_watched_weight_saves_copies_and_reloads_as_a_plain_params4bit(checkpoint, tmp_path):
    import copy

    model = _load(checkpoint, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _logits(model)
    copied = copy.deepcopy(model.get_submodule(LAYER).weight)
    assert type(copied) is bnb.nn.Params4bit and torch.equal(copied.data, before[f"{LAYER}.weight"])
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # bytes: what was loaded, not the repack
