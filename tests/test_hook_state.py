"""metapatch._offload.hook_state, the one reader of accelerate's hook state, on real accelerate hooks.

diagnose and the move guard each had their own ``_storage(hook)``: for a hook serving no weights map
the guard said "the offload store" and diagnose "cpu", and once metapatch's offload store put an
Overlay in front of a disk loader (an adapter merged into an offloaded layer) both said "cpu" for
weights still read from the offload folder. These tests ask every caller the same question about the
same hooks and check the answers against where the tensors really are."""

from __future__ import annotations

import importlib

import pytest

import metapatch  # noqa: F401 - first, as a user script does

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

from metapatch._offload import hook_state  # noqa: E402
from metapatch._offload.store import Overlay  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):  # noqa: D401
        return self.b(self.a(x))


def _disk_model(tmp_path):
    from accelerate import disk_offload

    model = _Net()
    disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    return model


def _cpu_model():
    from accelerate import cpu_offload

    model = _Net()
    cpu_offload(model, execution_device="cpu")
    return model


def _answers(model):
    """Where each caller says the model's offloaded weights live: (diagnose, move guard)."""
    diagnose = importlib.import_module("metapatch.diagnose")
    guard = importlib.import_module("metapatch.patches.offloaded_move_guard")

    finding = diagnose.diagnose(model).finding("offloaded")
    offloaded = guard._offloaded_modules(model)
    message = str(guard._refusal(model, "to('cuda')", "cuda", offloaded))
    said_by_guard = message.split("offloaded to ", 1)[1].split(":", 1)[0]
    said_by_diagnose = finding.summary.split("keep their weights on ", 1)[1].split(" and load", 1)[0]
    return said_by_diagnose, said_by_guard


def test_disk_and_cpu_offload_read_the_same_everywhere(tmp_path):
    disk, cpu = _disk_model(tmp_path), _cpu_model()
    assert _answers(disk) == ("disk", "disk")
    assert _answers(cpu) == ("cpu", "cpu")
    hook = hook_state.offload_hook(disk.a)
    found = hook_state.locate(hook.weights_map, "weight")
    assert found.store == hook_state.DISK and found.folder == str(tmp_path / "offload")
    assert isinstance(found.entry, dict)  # the index entry: nothing was read from the file
    assert hook_state.locate(hook.weights_map, "no_such_tensor") is None


def test_an_overlay_in_front_of_a_disk_loader_is_still_disk(tmp_path):
    model = _disk_model(tmp_path)
    for module in (model.a, model.b):
        hook = hook_state.offload_hook(module)
        overlay = Overlay(hook.weights_map)
        overlay.kept["bias"] = torch.zeros(4)  # what an operation wrote: kept in memory
        hook.weights_map = overlay
    assert _answers(model) == ("disk", "disk")  # both said "cpu" before there was one reader
    hook = hook_state.offload_hook(model.a)
    assert hook_state.locate(hook.weights_map, "bias").store == hook_state.CPU
    assert hook_state.locate(hook.weights_map, "weight").store == hook_state.DISK
    x = torch.randn(2, 4)
    reference = _Net()
    with torch.no_grad():
        reference.a.bias.zero_()
        reference.b.bias.zero_()
        assert torch.equal(model(x), reference(x))  # the overlay really serves the kept tensors


def test_a_hook_without_weights_map_is_the_offload_store():
    from accelerate.hooks import AlignDevicesHook

    hook = AlignDevicesHook(execution_device="cpu", offload=True, weights_map=None)
    assert hook_state.storage(hook) == hook_state.UNKNOWN  # diagnose's own copy said "cpu"
    module = torch.nn.Linear(2, 2)
    module._hf_hook = hook
    assert hook_state.offload_hooks(module) == [hook]
    assert hook_state.offload_hook(module) is None  # nothing to serve the weights from


def test_hooks_are_read_from_the_module_dict_only():
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    class Computing(torch.nn.Linear):
        @property
        def _hf_hook(self):  # a property that computes must not run (PEFT wrappers forward attributes)
            raise AssertionError("read through the property")

    module = Computing(2, 2)
    assert hook_state.hooks_on(module) == []
    off, on = AlignDevicesHook(offload=False), AlignDevicesHook(offload=True, weights_map={})
    plain = torch.nn.Linear(2, 2)
    plain.__dict__["_hf_hook"] = SequentialHook(off, on)
    assert hook_state.hooks_on(plain) == [off, on]
    assert hook_state.align_hooks(plain) == [off, on]
    assert hook_state.offload_hooks(plain) == [on]
    assert hook_state.offload_hook(plain) is on


def test_no_module_but_the_reader_reads_accelerates_hook_state():
    """``module._hf_hook``, ``hook.weights_map`` and ``hook.execution_device`` are read (and written) in hook_state
    only: a second reader is how diagnose and the move guard came to disagree (and how an int execution device
    came to be read three ways). Attribute access and the attribute's name
    as a string (``"_hf_hook" in module.__dict__``, ``getattr(hook, "weights_map")``) both count; the
    keyword ``weights_map=`` of accelerate's own functions does not."""
    import ast
    from pathlib import Path

    package = Path(metapatch.__file__).resolve().parent
    reader = package / "_offload" / "hook_state.py"
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == reader:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_hf_hook", "weights_map"):
                found.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Attribute) and node.attr == "execution_device" and not (
                    isinstance(node.value, ast.Name) and node.value.id == "_device"):  # the selftest's own choice
                found.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Call) and any(
                    isinstance(arg, ast.Constant) and arg.value in ("_hf_hook", "weights_map") for arg in node.args[1:2]):
                found.append(f"{path.relative_to(package)}:{node.lineno} {ast.unparse(node)[:60]}")
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and node.left.value == "_hf_hook":
                found.append(f"{path.relative_to(package)}:{node.lineno} {ast.unparse(node)[:60]}")
    assert found == []
