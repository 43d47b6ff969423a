"""offloaded-placeholder-writes, in process: a forward's own writes into what its hook loaded, and writes into offloaded
buffers between forwards (``offload_buffers=True``), equal the in-memory model's; the offload folder is never
written; eval-mode forwards keep nothing. Real ``dispatch_model`` with a disk map; the execution device is a
parameter (``cuda:0`` where CUDA is present, ``cpu`` always). The three-way proof is the ``batchnorm-statistics``
scenario (tests/patches/test_offloaded_placeholder_writes.py)."""

from __future__ import annotations

import copy
import hashlib

import pytest

import metapatch
from metapatch.patches.offloaded_placeholder_writes import PATCH

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)
pytestmark = pytest.mark.skipif(not AFFECTED, reason=f"{PATCH.id} not in range here: {WHY}")
DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.bn(self.lin(x)))


class _SelfScaling(torch.nn.Linear):
    """A layer whose forward scales its own weight in place (as a weight-clipping or EMA layer does)."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.5)
        return super().forward(x)


def _pair(tmp_path, device, model=None):
    from accelerate import dispatch_model

    torch.manual_seed(0)
    reference = (model if model is not None else _Net()).to(device)
    with torch.no_grad():  # statistics of an earlier training, which a recalibration resets
        reference.train()(torch.randn(8, 4, device=device))
    offloaded = copy.deepcopy(reference).cpu()
    folder = tmp_path / "offload"
    names = [name for name, _ in offloaded.named_children()]
    device_map = {name: "disk" if name in ("bn", "1") else device for name in names}
    dispatch_model(offloaded, device_map=device_map, offload_dir=str(folder), offload_buffers=True,
                   main_device=device)
    return reference, offloaded, folder


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_a_batchnorm_recalibration_equals_the_in_memory_model(tmp_path, device, grad_mode):
    reference, offloaded, folder = _pair(tmp_path, device)
    assert offloaded.bn.running_mean.is_meta
    before = _digests(folder)
    x = torch.randn(8, 4, device=device)
    for model in (reference, offloaded):
        model.bn.reset_running_stats()  # between forwards: a write into the buffers' placeholders
        model.bn.momentum = None
        model.train()
        with getattr(torch, grad_mode)():  # the forward updates the statistics in what its hook loaded
            model(x)
            model(x * 2 + 1)
        model.eval()
        with torch.no_grad():
            model.bn.running_var.mul_(2.0)  # and an edit after the recalibration
    with torch.no_grad():
        for _ in range(2):  # served again after the next offload
            assert torch.equal(offloaded(x), reference(x))
    assert _digests(folder) == before  # kept in memory, never in the offload folder


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_that_writes_its_own_weight_equals_the_in_memory_model(tmp_path, device):
    torch.manual_seed(1)
    reference, offloaded, _ = _pair(tmp_path, device, torch.nn.Sequential(torch.nn.Linear(4, 4), _SelfScaling(4, 2)))
    reference.eval(), offloaded.eval()
    x = torch.randn(3, 4, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(offloaded(x), reference(x))


@pytest.mark.parametrize("device", DEVICES)
def test_eval_forwards_keep_nothing(tmp_path, device):
    from metapatch._offload.store import Overlay

    _, offloaded, _ = _pair(tmp_path, device)
    offloaded.eval()
    with torch.no_grad():
        offloaded(torch.randn(8, 4, device=device))
        offloaded(torch.randn(8, 4, device=device))
    assert not isinstance(offloaded.bn._hf_hook.weights_map, Overlay)  # nothing written, nothing copied
    assert type(offloaded.bn.running_mean).__name__ == "OffloadedBuffer"  # marked for a write between forwards


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("init", ["dirac", "orthogonal", "trunc_normal"])
def test_an_init_that_returns_at_once_on_meta_reaches_an_offloaded_conv(tmp_path, device, init):
    """Since torch 2.13 ``torch.nn.init.dirac_``, ``orthogonal_``, ``trunc_normal_`` (and ``sparse_``) return before
    any write when the tensor is on meta, so upstream re-initialising an offloaded layer did nothing, silently;
    with the patch the function runs on the stored value (random ones drawing as in memory)."""
    from accelerate import dispatch_model

    torch.manual_seed(2)
    reference = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3, padding=1), torch.nn.Conv1d(4, 4, 3, padding=1))
    offloaded = copy.deepcopy(reference)
    reference.to(device)
    dispatch_model(offloaded, device_map={"0": device, "1": "disk"}, offload_dir=str(tmp_path / "offload"),
                   main_device=device)
    assert offloaded[1].weight.is_meta
    calls = {"dirac": lambda w: torch.nn.init.dirac_(w), "orthogonal": lambda w: torch.nn.init.orthogonal_(w),
             "trunc_normal": lambda w: torch.nn.init.trunc_normal_(w, std=0.5)}
    x = torch.randn(2, 4, 6, device=device)
    with torch.no_grad():
        untouched = reference(x)
        for model in (reference, offloaded):
            torch.manual_seed(3)
            calls[init](model[1].weight)
        assert not torch.equal(reference(x), untouched), "the init changed nothing: vacuous"
        if init != "dirac" and device != "cpu":
            # the stored value is in CPU memory, so a random init draws from the CPU generator, the in-memory
            # weight on the device from the device's: the same distribution, other numbers
            assert offloaded[1].weight.is_meta and not torch.equal(offloaded(x), untouched)
            return
        assert torch.equal(offloaded(x), reference(x))
