"""bnb-cpu-repack-copy: the byte-level CPU layout (metapatch._offload.bnb_fast_repack) of disk-offloaded
4-bit weights is bitsandbytes' own, and a disk-offloaded layer's forward with it equals the
in-memory model's. The layout check runs on any CPU (the conversion is plain
torch); the forward check runs the repack path where the CPU has it and says which path ran."""

from __future__ import annotations

import copy

import pytest

import metapatch  # noqa: F401 - first: the patches under test
from metapatch._offload import bnb_fast_repack as fast

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")
if not hasattr(F, "_convert_weight_packed_for_cpu"):
    pytest.skip(f"bitsandbytes {bnb.__version__} has no CPU repack (added in 0.49.0)", allow_module_level=True)


@pytest.mark.parametrize("shape", [(64, 128), (96, 64), (256, 512)], ids=str)
@pytest.mark.parametrize("quant", [("nf4", True, torch.uint8), ("fp4", False, torch.uint8),
                                   ("nf4", True, torch.bfloat16), ("nf4", False, torch.float32)], ids=str)
def test_byte_layout_is_bitsandbytes_layout(shape, quant):
    quant_type, double_quant, storage = quant
    torch.manual_seed(sum(shape))
    weight, state = F.quantize_4bit(torch.randn(*shape, dtype=torch.bfloat16), quant_type=quant_type,
                                    compress_statistics=double_quant, quant_storage=storage, blocksize=64)
    want, packed_state = F._convert_weight_packed_for_cpu(weight.clone(), copy.deepcopy(state))
    got = fast.packed_weight(weight, packed_state, F._convert_weight_packed_for_cpu)
    assert got is not None and got.dtype == want.dtype and torch.equal(got, want)


def test_the_proof_calls_no_quantizer():
    """bnb-quant-state-offload's scenarios count quantizer calls at reloads (there must be none)."""
    from metapatch.selftest import _bnb as scenario

    weight, state = F.quantize_4bit(torch.randn(192, 128, dtype=torch.bfloat16), quant_type="nf4", blocksize=64)
    _, packed_state = F._convert_weight_packed_for_cpu(weight.clone(), copy.deepcopy(state))
    fast._PROVEN.pop((192, 128, 64), None)
    with scenario.counting_quantize_calls() as counts:
        assert fast.packed_weight(weight, packed_state, F._convert_weight_packed_for_cpu) is not None
    assert not any(counts.values()), counts


def test_a_different_layout_is_not_used():
    """A conversion whose permutation differs (here: rows reversed) fails the proof for its shape."""
    def other(qweight, state):
        packed, packed_state = F._convert_weight_packed_for_cpu(qweight, state)
        return packed.flip(0), packed_state

    weight, state = F.quantize_4bit(torch.randn(160, 64, dtype=torch.bfloat16), quant_type="nf4", blocksize=64)
    _, packed_state = F._convert_weight_packed_for_cpu(weight.clone(), copy.deepcopy(state))
    fast._PROVEN.pop((160, 64, 64), None)
    try:
        assert fast.packed_weight(weight, packed_state, other) is None
    finally:
        fast._PROVEN.pop((160, 64, 64), None)


def test_disk_offloaded_forwards_equal_in_memory(tmp_path):
    import accelerate  # noqa: F401

    from metapatch.selftest import _bnb as scenario
    from metapatch.selftest._models import input_ids, save_tiny_llama

    save_tiny_llama(tmp_path / "base", hidden_size=128, intermediate_size=256, num_hidden_layers=scenario.NUM_LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    ids = input_ids(vocab_size=256, length=8)
    config = scenario.quant_config("nf4", True, "bfloat16")
    # The CPU repack path: quantized and computing on the CPU whatever the machine has.
    in_memory = scenario.load_quantized(tmp_path / "base", config, device="cpu")
    dispatched = scenario.dispatch(scenario.load_quantized(tmp_path / "base", config, device="cpu"), tmp_path / "work",
                                   main_device="cpu")
    with torch.no_grad():  # bitsandbytes' conversion at the first forward, the proof (once per shape) at the second
        want = [in_memory(ids).logits for _ in range(2)]
        got = [dispatched(ids).logits for _ in range(2)]
    calls = {"bytes": 0, "bitsandbytes": 0}
    originals = fast._permuted, F._convert_weight_packed_for_cpu

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    fast._permuted = counted("bytes", originals[0])
    import bitsandbytes.nn.modules as modules

    modules_original = getattr(modules, "_convert_weight_packed_for_cpu", None)
    F._convert_weight_packed_for_cpu = counted("bitsandbytes", originals[1])
    import metapatch.patches.bnb_cpu_repack_copy as patch

    patch_original = getattr(patch, "_convert_weight_packed_for_cpu", None)
    try:
        with torch.no_grad():
            want += [in_memory(ids).logits for _ in range(2)]
            got += [dispatched(ids).logits for _ in range(2)]
    finally:
        fast._permuted, F._convert_weight_packed_for_cpu = originals
        if modules_original is not None:
            modules._convert_weight_packed_for_cpu = modules_original
        if patch_original is not None:
            patch._convert_weight_packed_for_cpu = patch_original
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    repacks = bool(F.has_avx512bf16()) if hasattr(F, "has_avx512bf16") else False
    print(f"bitsandbytes CPU repack path: {'yes' if repacks else 'no'}; byte-level repacks {calls['bytes']}")
    if repacks:
        # The disk-offloaded Linear4bit layers after their first forward: the byte layout at every
        # forward, bitsandbytes' conversion never (the in-memory model keeps its copies).
        assert calls == {"bytes": 2 * len(scenario.offloaded_linears(dispatched)), "bitsandbytes": 0}, calls
    else:
        assert calls["bytes"] == 0, calls
