"""accelerate-redispatch-guard: three-way proof on a tiny Llama loaded with layers on disk and placed again with
cpu_offload, disk_offload and dispatch_model (subprocesses); and in-process checks that a call bringing its own
values, a one-device map and a model with nothing offloaded reach upstream untouched."""

from __future__ import annotations

import pytest

from metapatch.patches.accelerate_redispatch_guard import PATCH, RedispatchOffloadedError

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)


torch = pytest.importorskip("torch")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).eval()


def _offloaded(folder):
    from accelerate import dispatch_model

    model = _model()
    dispatch_model(model, {"0": "cpu", "1": "disk"}, main_device="cpu", offload_dir=str(folder / "first"))
    assert model[1].weight.is_meta
    return model


def _not_refused(call):
    """Upstream decides (its own answer or its own error): the guard stays out of calls that bring values."""
    try:
        return call()
    except RedispatchOffloadedError as exc:
        raise AssertionError(f"refused a call upstream can serve: {exc}") from exc
    except Exception:
        return None


def test_refused_before_anything_is_written(tmp_path):
    import metapatch
    from accelerate import cpu_offload, disk_offload, dispatch_model

    assert {row["id"]: row["state"] for row in metapatch.status()}[PATCH.id] == "applied"
    model = _offloaded(tmp_path)
    x = torch.ones(1, 4)
    with torch.no_grad():
        before = model(x)
        assert torch.equal(before, _model()(x))
    for call in (lambda: cpu_offload(model),
                 lambda: disk_offload(model, str(tmp_path / "new")),
                 lambda: dispatch_model(model, {"0": "disk", "1": "disk"}, offload_dir=str(tmp_path / "new"))):
        with pytest.raises(RedispatchOffloadedError, match=r"already offloads \(2 tensors, e\.g\. 1\.weight on disk\)"):
            call()
        assert not (tmp_path / "new").exists()
        with torch.no_grad():
            assert torch.equal(model(x), before)


def test_calls_that_bring_their_values_reach_upstream(tmp_path):
    from accelerate import cpu_offload, disk_offload, dispatch_model

    x = torch.ones(1, 4)
    with torch.no_grad():
        want = _model()(x)
    state = _model().state_dict()
    model = cpu_offload(_offloaded(tmp_path / "a"), execution_device="cpu", state_dict=state)
    with torch.no_grad():
        assert torch.equal(model(x), want)  # upstream's answer from the values given
        assert torch.equal(cpu_offload(_model(), execution_device="cpu")(x), want)  # nothing offloaded
    _not_refused(lambda: disk_offload(_offloaded(tmp_path / "b"), str(tmp_path / "b" / "first")))  # has index.json
    _not_refused(lambda: dispatch_model(_offloaded(tmp_path / "c"), {"": "cpu"}))  # one device: model.to's
    _not_refused(lambda: dispatch_model(_offloaded(tmp_path / "d"), {"0": "cpu", "1": "disk"},
                                        offload_dir=str(tmp_path / "d" / "first")))  # the folder's index
