"""offloaded-placeholder-writes, in process: writes into the packed bytes of an offloaded bitsandbytes 4-bit weight
(``Params4bit``) equal the in-memory 4-bit model's; the offload folder and the checkpoint are never written.

Real ``from_pretrained`` with a ``BitsAndBytesConfig`` and a map putting decoder layer 1 on disk and layer 2 on cpu
(GPU 0 for the rest where CUDA is present: the cpu layer is offloaded there; on a CPU-only machine it stays in
memory), and real ``accelerate.cpu_offload`` of a 4-bit model (every weight behind a CPU weights map). The execution
device is a parameter (``cuda:0`` where CUDA is present, ``cpu`` always). Before this, each write below went into
the meta placeholder and was lost, silently (logits off by 0.0026 to 0.12 on this model, measured on the CPU).

The reference is the in-memory 4-bit model written before its first forward: on a CPU with AVX512-BF16 bitsandbytes
repacks an in-memory weight in place at its first no-grad forward, after which the same byte offsets address another
layout; an offloaded weight is served in the portable layout at every forward, as an in-memory one is on a GPU."""

from __future__ import annotations

import hashlib

import pytest
from packaging.version import Version

import metapatch
from metapatch._offload.offloaded_weights import OffloadedWriteError
from metapatch.patches.offloaded_placeholder_writes import PATCH

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)
_FIVE = Version(transformers.__version__).release >= (5, 1)
pytestmark = [pytest.mark.skipif(not AFFECTED, reason=f"{PATCH.id} not in range here: {WHY}"),
              pytest.mark.skipif(not _FIVE, reason="4-bit layers mapped to disk load on this path from "
                                                   "transformers 5.1.0 (transformers-quantized-disk-weights)")]
DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
WEIGHT = "model.layers.1.mlp.down_proj.weight"


def _weight(model):
    return model.get_submodule("model.layers.1.mlp.down_proj").weight


def _pattern(like):
    return (torch.arange(like.numel(), dtype=torch.int64) * 37 % 256).to(torch.uint8).reshape(like.shape)


WRITES = {
    "data-zero": lambda w: w.data.zero_(),
    "rows-under-no-grad": lambda w: w.__setitem__(slice(0, 64), 0),
    "data-slice-fill": lambda w: w.data[100:200].fill_(0x77),
    "copy-from-cpu-bytes": lambda w: w.data.copy_(_pattern(w)),
    "detach-bitwise-xor": lambda w: w.detach().bitwise_xor_(0x0F),
}


def _write(model, kind):
    with torch.no_grad():
        WRITES[kind](_weight(model))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from metapatch.selftest.transformers_quantized_disk_weights import checkpoint as tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("placeholder-writes-4bit"))


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _models(checkpoint, tmp_path, device, how):
    from metapatch.selftest import transformers_quantized_disk_weights as quantized

    index = 0 if device.startswith("cuda") else "cpu"
    reference = quantized.load(checkpoint, quantized.quant_config(fp32_cpu_offload=False), {"": index})
    folder = tmp_path / "offload"
    if how == "disk-map":
        model = quantized.load_auto(checkpoint, quantized.quant_config(),
                                    quantized.placement(index, {1: "disk", 2: "cpu"}), folder)
    else:
        from accelerate import cpu_offload

        model = quantized.load(checkpoint, quantized.quant_config(fp32_cpu_offload=False), {"": index})
        cpu_offload(model, execution_device=torch.device(device))
    assert _weight(model).is_meta and isinstance(_weight(model), type(_weight(reference))), type(_weight(model))
    return reference, model, folder


def _logits(model):
    from metapatch.selftest._models import input_ids

    with torch.no_grad():
        return model(input_ids().to(model.device)).logits.float().cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["disk-map", "cpu_offload"])
@pytest.mark.parametrize("after_forward", [False, True], ids=["before-forward", "after-forward"])
@pytest.mark.parametrize("kind", sorted(WRITES))
def test_a_write_into_an_offloaded_4bit_weight_equals_the_in_memory_model(checkpoint, tmp_path, device, how,
                                                                          after_forward, kind):
    before = _digests(checkpoint)
    reference, model, folder = _models(checkpoint, tmp_path, device, how)
    _write(reference, kind)  # before its first forward (see the module's docstring)
    expected = _logits(reference)
    untouched = _logits(model)
    assert not torch.equal(expected, untouched), "the write changed nothing: the comparison would be vacuous"
    if not after_forward:
        reference, model, folder = _models(checkpoint, tmp_path / "again", device, how)
    stored = _digests(folder) if folder.exists() else {}
    state = _weight(model).quant_state
    _write(model, kind)
    assert torch.equal(_logits(model), expected)
    assert torch.equal(_logits(model), expected)  # served again after the next offload
    assert _weight(model).is_meta and _weight(model).quant_state is state  # the quant state is not written
    assert (_digests(folder) if folder.exists() else {}) == stored and _digests(checkpoint) == before


@pytest.mark.parametrize("device", DEVICES)
def test_writes_between_forwards_accumulate_as_in_memory(checkpoint, tmp_path, device):
    """Each write lands on the value the last one kept (written in place there): a repacked copy of the bytes
    before it must not be served after it (bitsandbytes' CPU kernel layout, bnb-cpu-repack-copy)."""
    reference, model, _ = _models(checkpoint, tmp_path, device, "disk-map")
    kinds = ["rows-under-no-grad", "data-slice-fill", "detach-bitwise-xor"]
    for kind in kinds:
        _write(reference, kind)
    expected = _logits(reference)
    seen = [_logits(model)]
    for kind in kinds:
        _write(model, kind)
        seen.append(_logits(model))
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:])), "a write was not served at the next forward"
    assert torch.equal(seen[-1], expected)


def test_a_write_of_unknown_values_or_another_shape_is_refused_and_keeps_nothing(checkpoint, tmp_path):
    reference, model, _ = _models(checkpoint, tmp_path, "cpu", "disk-map")
    expected = _logits(model)
    weight = _weight(model)
    with pytest.raises(OffloadedWriteError, match="meta"):
        with torch.no_grad():
            weight.data.copy_(torch.zeros(weight.shape, dtype=weight.dtype, device="meta"))
    with pytest.raises(OffloadedWriteError, match="shape or dtype"):
        weight.data = torch.zeros(3, dtype=torch.uint8)
    assert torch.equal(_logits(model), expected)


def test_a_4bit_placeholder_keeps_bitsandbytes_class_name_and_loads_as_plain_params4bit(checkpoint, tmp_path):
    """accelerate rebuilds a 4-bit parameter by its class name, and transformers counts 4-bit parameters by it."""
    import bitsandbytes as bnb

    reference, model, _ = _models(checkpoint, tmp_path, "cpu", "disk-map")
    assert type(_weight(model)).__name__ == "Params4bit" and type(_weight(model)) is not bnb.nn.Params4bit
    loaded = []
    module = model.get_submodule("model.layers.1.mlp.down_proj")
    # the forward accelerate's hook wraps (where the hook sits on this module), else the module's own
    inner = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    original = getattr(module, inner)

    def recording(*args, **kwargs):  # runs after the offload hook loaded the weight
        loaded.append(type(module.weight))
        return original(*args, **kwargs)

    setattr(module, inner, recording)
    try:
        _logits(model)
    finally:
        setattr(module, inner, original)
    assert loaded == [bnb.nn.Params4bit], loaded
    assert model.num_parameters() == reference.num_parameters()


@pytest.mark.parametrize("device", DEVICES)
def test_a_deep_copy_of_a_4bit_offloaded_model_computes_as_the_original_and_keeps_its_own_writes(checkpoint, tmp_path,
                                                                                                 device):
    """A reference model for DPO/PPO is a deep copy. Upstream it fails (torch's ``set_data`` given a meta 4-bit
    placeholder's copy; with metapatch before this, wrapt's refusal to copy the wrapped ``Linear4bit.forward``
    accelerate keeps as ``_old_forward``). The copy computes as the original, and a write into it is its own."""
    import copy

    reference, model, folder = _models(checkpoint, tmp_path, device, "disk-map")
    before = _logits(model)
    # the attribute transformers 5.x sets on a parameter it loaded (set here: not every release leaves it on an
    # offloaded one): the copy has it too, and bitsandbytes < 0.50, whose Params4bit takes no keyword it does not
    # name, copies too (accelerate >= 1.14 pops this one before rebuilding the weight for a forward)
    _weight(model)._is_hf_initialized = True
    twin = copy.deepcopy(model)
    assert _weight(twin).__dict__.get("_is_hf_initialized") is True and _weight(twin) is not _weight(model)
    assert torch.equal(_logits(twin), before)
    _write(twin, "data-zero")
    _write(reference, "data-zero")
    assert torch.equal(_logits(twin), _logits(reference))
    assert torch.equal(_logits(model), before)
