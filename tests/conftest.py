import importlib.util
import os
import re

import pytest

# Libraries the suite uses where they are installed, and which an environment may lack (the GPU image has neither):
# a test that ran into one of them missing is skipped, saying so, unless the session installs every one.
OPTIONAL_LIBRARIES = ("peft", "bitsandbytes")
_MISSING = re.compile(r"No module named '(%s)[.']" % "|".join(OPTIONAL_LIBRARIES))


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


def _patch_not_installed(module) -> str:
    """Why the patches a test module tests (the records it imports) cannot run here: a distribution one of them
    patches is not installed (bitsandbytes or peft in a minimal environment), as ``metapatch selftest`` says and
    skips; '' otherwise."""
    from metapatch._framework.records import Patch

    patches = [value for value in vars(module).values() if isinstance(value, Patch)]
    if not patches:
        return ""
    import metapatch

    for patch in patches:
        affected, why = metapatch.registry.gate(patch)[:2]
        if not affected and why.endswith(" is not installed"):
            return why
    return ""


def pytest_collection_modifyitems(config, items):
    have = cuda_devices()
    missing = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ not in missing:
            missing[module.__name__] = _patch_not_installed(module)
        why = missing.get(getattr(module, "__name__", None), "")
        if why and _every_library_required():
            raise pytest.UsageError(f"{module.__name__}: {why}, in a session that installs every patched library "
                                    f"(METAPATCH_TESTS_EVERY_LIBRARY=1): the install is broken")
        if why:
            item.add_marker(pytest.mark.skip(reason=f"{why} (the patch's library: nothing of it can run here)"))
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


def _every_library_required() -> bool:
    return os.environ.get("METAPATCH_TESTS_EVERY_LIBRARY") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test (or its fixture) that failed because a run it started imported an optional library that is not
    installed here (a scenario or report reproducer reaching peft, a 4-bit one bitsandbytes) is reported skipped with
    that reason: the test could not measure anything here. Only for a library that really is missing, and never in a
    nox session (METAPATCH_TESTS_EVERY_LIBRARY=1), where it stays a failure."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or _every_library_required():
        return
    found = _MISSING.search(str(report.longrepr))
    if found is None or importlib.util.find_spec(found.group(1)) is not None:
        return
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0,
                       f"Skipped: needs {found.group(1)} (not installed here; a run of this test imported it)")
