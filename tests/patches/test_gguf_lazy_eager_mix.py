"""gguf-lazy-eager-mix: three-way proof with the real ``gguf`` package (subprocesses), plus in-process
checks of what the replacement hands the meta pass and the real evaluation.

The lazy torch tensor type is the minimal one in metapatch.selftest.gguf_lazy_eager_mix (built on
``gguf.lazy.LazyBase`` as llama.cpp's converter builds its own), and the arithmetic is BitNet's
2-bit unpacking with an eagerly built shift tensor.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import metapatch
from metapatch.diffs import diffs_for
from metapatch.patches.gguf_lazy_eager_mix import PATCH
from metapatch.selftest import run_scenario, scenarios_for

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

PATCH_ID = PATCH.id
SCENARIOS = scenarios_for(PATCH_ID)
AFFECTED, WHY, VERSIONS, _ = metapatch.registry.gate(PATCH)
DEVICE_ERROR = "Tensor on device cpu is not on the expected device meta!"

needs_gguf = pytest.mark.skipif(VERSIONS.get("gguf") is None, reason="the gguf package is not installed")


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH_ID,)
    names = {PATCH_ID: {"bitnet-unpack"}}

    def check_patched(self, scenario, outcome):
        assert outcome.metrics["elements"] == 32 * 24


def test_diff_is_the_lazy_module_alone():
    (diff,) = diffs_for(PATCH_ID)
    assert diff.package == "gguf" and [s.path for s in diff.package_sections()] == ["gguf-py/gguf/lazy.py"]


def test_not_applicable_without_gguf(tmp_path):
    # a gguf that cannot be imported, first on the child's path: the scenario must say n/a, not fail
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "__init__.py").write_text("raise ImportError('no gguf here')\n")
    outcome = run_scenario(SCENARIOS[0], patched=True, pythonpath=[str(tmp_path)])
    assert outcome.not_applicable and "gguf" in outcome.not_applicable
    assert not outcome.passed and outcome.error_type in (None, "NotApplicable")


# -- in-process: the replacement as installed in this test process ------------------------------

needs_patch = pytest.mark.skipif(not AFFECTED, reason=f"patch not active here: {WHY}")


@pytest.fixture
def lazy_type():
    from metapatch.selftest.gguf_lazy_eager_mix import lazy_torch_tensor_type

    return lazy_torch_tensor_type()


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def gguf_lazy():
    return pytest.importorskip("gguf.lazy")


@needs_patch
def test_installed_state(gguf_lazy):
    row = next(r for r in metapatch.status() if r["id"] == PATCH_ID)
    assert row["state"] == "applied", row


@needs_patch
def test_real_evaluation_gets_the_eager_tensor_itself(lazy_type, torch):
    seen = []

    def add_and_record(a, b):
        seen.append((a.device.type, b))
        return a + b

    eager = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    lazy = lazy_type.from_eager(torch.ones(2, 3))
    result = lazy_type._wrap_fn(add_and_record)(lazy, eager)
    assert isinstance(result, lazy_type) and result._meta.device.type == "meta"
    assert seen[0][0] == "meta" and seen[0][1].device.type == "meta"  # the meta pass: stand-ins only
    value = lazy_type.to_eager(result)
    assert seen[1][0] == "cpu" and seen[1][1] is eager  # the real evaluation: the very eager tensor
    assert torch.equal(value, torch.ones(2, 3) + eager)


@needs_patch
def test_eager_tensors_inside_lists_and_broadcasting(lazy_type, torch):
    lazy = lazy_type.from_eager(torch.arange(4, dtype=torch.float32).reshape(2, 2))
    eager = torch.full((1, 2), 10.0)
    joined = torch.cat([lazy, eager], dim=0)  # eager inside a list argument
    assert tuple(joined._meta.shape) == (3, 2)
    assert torch.equal(lazy_type.to_eager(joined), torch.tensor([[0.0, 1.0], [2.0, 3.0], [10.0, 10.0]]))
    scaled = lazy * torch.tensor([[1.0], [-1.0]])  # broadcasting decided in the meta pass
    assert torch.equal(lazy_type.to_eager(scaled), torch.tensor([[0.0, 1.0], [-2.0, -3.0]]))


@needs_patch
def test_reversed_operands_and_dtype_promotion(lazy_type, torch):
    packed = torch.tensor([[0b11100100, 0b00011011]], dtype=torch.uint8)
    lazy = lazy_type.from_eager(packed)
    shifted = torch.tensor([[2], [4]], dtype=torch.uint8) >> 1 << lazy.view(torch.uint8) * 0  # eager first
    assert torch.equal(lazy_type.to_eager(shifted), torch.tensor([[1, 1], [2, 2]], dtype=torch.uint8))
    promoted = lazy.float() / torch.tensor([2.0], dtype=torch.bfloat16)
    assert lazy_type.to_eager(promoted).dtype == (packed.float() / torch.tensor([2.0], dtype=torch.bfloat16)).dtype


@needs_patch
def test_numpy_lazy_tensors_unchanged(gguf_lazy):
    import numpy as np

    lazy = gguf_lazy.LazyNumpyTensor.from_eager(np.arange(6, dtype=np.float32).reshape(2, 3))
    total = lazy + np.ones((1, 3), dtype=np.float32)
    assert np.array_equal(gguf_lazy.LazyNumpyTensor.to_eager(total), np.arange(6).reshape(2, 3) + 1)


@needs_patch
def test_unpatch_restores_the_original_error(lazy_type, torch, gguf_lazy):
    from metapatch.selftest.gguf_lazy_eager_mix import bitnet_inputs, unpack_bitnet

    _, packed, scale = bitnet_inputs()
    metapatch.unpatch(PATCH_ID)
    try:
        assert "_self_metapatch" not in vars(gguf_lazy.LazyBase._wrap_fn.__func__)
        with pytest.raises(RuntimeError, match="expected device meta"):
            # torch functions reach the meta pass in every gguf version (operators only from 0.16.2)
            unpack_bitnet(lazy_type.from_eager(packed), lazy_type.from_eager(scale), functions=True)
    finally:
        metapatch.install([PATCH_ID])
    lazy = unpack_bitnet(lazy_type.from_eager(packed), lazy_type.from_eager(scale), functions=True)
    assert torch.equal(lazy_type.to_eager(lazy), unpack_bitnet(packed, scale))


# -- end to end: llama.cpp's convert_hf_to_gguf.py on a tiny BitNet checkpoint ---------------------
#
# METAPATCH_LLAMA_CPP=/path/to/llama.cpp (a checkout with convert_hf_to_gguf.py; nothing of it is
# copied here). The converter imports the checkout's own gguf-py; the installed gguf distribution
# is what the patch's version gate reads.

LLAMA_CPP = os.environ.get("METAPATCH_LLAMA_CPP", "")
CONVERTER = Path(LLAMA_CPP) / "convert_hf_to_gguf.py" if LLAMA_CPP else None
needs_converter = pytest.mark.skipif(
    CONVERTER is None or not CONVERTER.is_file(),
    reason="set METAPATCH_LLAMA_CPP to a llama.cpp checkout (with convert_hf_to_gguf.py) to run the converter")

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _gguf_name(checkpoint_name: str) -> str:
    parts = checkpoint_name.split(".")  # model.layers.{i}.{self_attn|mlp}.{proj}.weight
    return f"blk.{parts[2]}.{GGUF_NAMES[parts[4]]}.weight"


def _convert(checkpoint: Path, outfile: Path, *extra: str, metapatch_run: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(metapatch.__file__).resolve().parents[1])
    if not metapatch_run:
        env["METAPATCH_AUTOLOAD"] = "0"  # even where `metapatch enable` is active
    prefix = [sys.executable, "-m", "metapatch", "run"] if metapatch_run else [sys.executable]
    return subprocess.run([*prefix, str(CONVERTER), str(checkpoint), "--outfile", str(outfile), *extra],
                          cwd=checkpoint, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def bitnet_checkpoint(tmp_path_factory):
    from metapatch.selftest import NotApplicable
    from metapatch.selftest.gguf_lazy_eager_mix import save_tiny_bitnet

    directory = tmp_path_factory.mktemp("bitnet") / "ckpt"
    try:
        # llama.cpp's tensor map knows BitNet's sub-norms only under 1bitLLM's names (see README)
        ternaries = save_tiny_bitnet(directory, llama_cpp_sub_norm_names=True)
    except NotApplicable as exc:
        pytest.skip(str(exc))
    return directory, ternaries


def _tensors(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


@needs_converter
@needs_gguf
def test_converter_fails_without_metapatch(bitnet_checkpoint, tmp_path):
    checkpoint, _ = bitnet_checkpoint
    done = _convert(checkpoint, tmp_path / "plain.gguf", "--outtype", "f32", metapatch_run=False)
    assert done.returncode != 0
    assert DEVICE_ERROR in done.stderr and "dequant_bitnet" in done.stderr, done.stderr[-3000:]


@needs_converter
@needs_gguf
def test_converter_under_metapatch_run_f32_equals_eager_conversion(bitnet_checkpoint, tmp_path):
    import numpy as np

    checkpoint, ternaries = bitnet_checkpoint
    lazy = _convert(checkpoint, tmp_path / "lazy.gguf", "--outtype", "f32", metapatch_run=True)
    assert lazy.returncode == 0, lazy.stderr[-3000:]
    eager = _convert(checkpoint, tmp_path / "eager.gguf", "--outtype", "f32", "--no-lazy", metapatch_run=False)
    assert eager.returncode == 0, eager.stderr[-3000:]
    converted, reference = _tensors(tmp_path / "lazy.gguf"), _tensors(tmp_path / "eager.gguf")
    assert set(converted) == set(reference)
    for name, tensor in converted.items():  # the lazy conversion is the eager one, bit for bit
        assert np.array_equal(np.asarray(tensor.data), np.asarray(reference[name].data)), name
    for name, (ternary, scale) in ternaries.items():
        values = np.asarray(converted[_gguf_name(name)].data)
        expected_signs = ternary.numpy()
        assert values.shape == expected_signs.shape
        assert np.array_equal(np.sign(values), expected_signs), name  # the ternary pattern itself
        # The converter re-quantizes the dequantized weight (ternary / weight_scale) with its absmean,
        # so every non-zero is +-(mean |ternary| / weight_scale): one magnitude per tensor.
        dequantized = ternary.numpy() / np.float32(scale.float().item())
        magnitude = np.abs(dequantized).mean(dtype=np.float64)
        assert np.allclose(np.abs(values[values != 0]), magnitude, rtol=1e-6, atol=0), name


@needs_converter
@needs_gguf
def test_converter_under_metapatch_run_tq2_0(bitnet_checkpoint, tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    checkpoint, ternaries = bitnet_checkpoint
    done = _convert(checkpoint, tmp_path / "tq2.gguf", "--outtype", "tq2_0", metapatch_run=True)
    if done.returncode != 0 and "tq2_0" in done.stderr and "invalid choice" in done.stderr:
        pytest.skip("this converter has no --outtype tq2_0")
    assert done.returncode == 0, done.stderr[-3000:]
    converted = _tensors(tmp_path / "tq2.gguf")
    for name, (ternary, scale) in ternaries.items():
        tensor = converted[_gguf_name(name)]
        assert tensor.tensor_type == GGMLQuantizationType.TQ2_0, name
        values = dequantize(tensor.data, tensor.tensor_type)
        signs = ternary.numpy()
        assert np.array_equal(np.sign(values), signs), name
        # each 256-value block stores its magnitude as float16
        magnitude = np.abs(signs / np.float32(scale.float().item())).mean(dtype=np.float64)
        assert np.array_equal(np.abs(values[values != 0]),
                              np.full(int((values != 0).sum()), np.float32(np.float16(magnitude)))), name
