import os

import pytest


def cuda_devices() -> int:
    """CUDA devices the ``gpu`` tests may use: none where METAPATCH_SELFTEST_DEVICE=cpu runs the suite as on a
    CPU-only machine (the scenarios then compute on the CPU too)."""
    if os.environ.get("METAPATCH_SELFTEST_DEVICE", "").strip().lower() == "cpu":
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    have = cuda_devices()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            need = marker.kwargs.get("count", marker.args[0] if marker.args else 1)
            if have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {have}"))


@pytest.fixture(autouse=True)
def _no_inherited_disable(monkeypatch):
    # A developer's METAPATCH_DISABLE must not change what the tests prove. METAPATCH_STRICT is
    # kept on purpose: the matrix runs strict, so a stale patch fails the run.
    monkeypatch.delenv("METAPATCH_DISABLE", raising=False)
