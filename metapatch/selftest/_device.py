"""Where a scenario computes, decided in one place, and what a process that may meet CUDA must not do.

*The execution device.* A scenario computes where a user's model would: ``cuda:0`` where torch sees a
CUDA device (GPU 0 in the device map, the offloaded rest on ``cpu``/``disk``), ``cpu`` otherwise, as
transformers' and accelerate's test suites decide their ``torch_device``. ``METAPATCH_SELFTEST_DEVICE``
overrides the choice (``cpu``, ``cuda``, ``cuda:N``; ``auto`` or unset: decide), for tests and for CPU
dry runs. The decision is made lazily in the process that runs the scenario (a forked or fresh child),
never in the warm parent it was forked from, and the scenario's builders all ask :func:`execution_device`.

*Pinned to the CPU.* A scenario that cannot compute on a GPU (two ranks over gloo; a bug of a CPU-only
kernel path) says so on its ``Scenario(device="cpu", device_reason=...)``. The harness then starts its
process with CUDA hidden (:func:`pin_environment`: ``CUDA_VISIBLE_DEVICES=""``, and torch's NVML-based
availability check, which reads that variable without initialising the CUDA driver) and the reason in
``METAPATCH_SELFTEST_DEVICE_PIN``; the outcome records both.

*Forks.* A process in which CUDA was initialised (torch's lazy init, or merely the driver, which
``torch.cuda.is_available()`` initialises) cannot hand a working CUDA to a forked child: the child gets
"Cannot re-initialize CUDA in forked subprocess" or "CUDA error: initialization error".
:func:`cuda_touched` says whether that happened here; the warm parent (``_zygote``) and the forked ranks
(``_ranks``) ask it before they fork, and :func:`preload_plan` keeps modules that initialise CUDA at
import (bitsandbytes) out of a warm parent that may meet a GPU.

The decisions are plain functions of what they read, so tests exercise the CUDA branches on a CPU
machine: ``METAPATCH_SELFTEST_SIMULATE_CUDA=present`` (a CUDA build that sees a GPU, nothing initialised
yet) or ``=initialised`` (this process initialised CUDA) changes what :func:`cuda_built` and
:func:`cuda_touched` report, never where anything computes.

Loaded by path by the warm parent (which must not import the package's ``__init__``): no relative
imports at module level, torch imported lazily.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

DEVICE_ENV = "METAPATCH_SELFTEST_DEVICE"
PIN_ENV = "METAPATCH_SELFTEST_DEVICE_PIN"  # why a pinned scenario runs on cpu (set by the harness)
SIMULATE_ENV = "METAPATCH_SELFTEST_SIMULATE_CUDA"  # tests only: "present" or "initialised"
# What hides CUDA from a process before torch looks: the driver reads CUDA_VISIBLE_DEVICES when it
# initialises; with PYTORCH_NVML_BASED_CUDA_CHECK=1, torch.cuda.is_available() counts the visible
# devices through NVML (none here) instead of initialising the driver to ask.
HIDDEN_CUDA = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
# The variables a run's process reads when it runs (never at import): a warm parent is shared by runs
# that differ only in these.
RUN_TIME_VARIABLES = (DEVICE_ENV, PIN_ENV, *HIDDEN_CUDA)
# Modules that initialise CUDA when imported on a machine with a GPU (bitsandbytes picks its native
# library: torch.cuda.is_available(), then the device capability, which is torch's full lazy init).
CUDA_AT_IMPORT = {"bitsandbytes": "initialises CUDA at import (it picks its native library)"}

_DEVICE_SYNTAX = re.compile(r"^(cpu|cuda(:\d+)?)$")
_decided: Optional[str] = None


# -- the execution device -------------------------------------------------------------------------

def requested(value: Optional[str]) -> Optional[str]:
    """The device ``METAPATCH_SELFTEST_DEVICE=value`` asks for, normalised (``cuda`` -> ``cuda:0``);
    None for ``auto`` or unset (decide from what torch sees). ValueError for anything else."""
    value = (value or "").strip().lower()
    if value in ("", "auto"):
        return None
    if not _DEVICE_SYNTAX.match(value):
        raise ValueError(f"{DEVICE_ENV}={value!r}: expected cpu, cuda, cuda:N or auto")
    return "cuda:0" if value == "cuda" else value


def choose(request: Optional[str], cuda_devices: int) -> str:
    """The execution device: ``request`` where given (a CUDA index torch does not see is an error, not a
    silent fallback to the CPU), else ``cuda:0`` with at least one CUDA device, else ``cpu``."""
    if request is None:
        return "cuda:0" if cuda_devices > 0 else "cpu"
    if request.startswith("cuda") and int(request.partition(":")[2] or 0) >= cuda_devices:
        raise RuntimeError(f"{DEVICE_ENV}={request}, but torch sees {cuda_devices} CUDA device(s)")
    return request


def visible_cuda_devices() -> int:
    """How many CUDA devices torch sees in this process (initialises the CUDA driver where it is a
    CUDA build and CUDA is not hidden: ask it in the process that will compute, never before a fork)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def execution_device() -> str:
    """This process's execution device (decided once; see the module docstring)."""
    global _decided
    if _decided is None:
        request = requested(os.environ.get(DEVICE_ENV))
        # A cpu request never asks CUDA anything: a pinned scenario's process leaves the driver alone.
        _decided = choose(request, 0 if request == "cpu" else visible_cuda_devices())
    return _decided


def on_gpu() -> bool:
    return execution_device() != "cpu"


def main_device() -> Union[int, str]:
    """The execution device as a device-map value (an accelerate/transformers map names GPU 0 as ``0``)."""
    device = execution_device()
    return int(device.partition(":")[2]) if device.startswith("cuda") else device


def gpu_count() -> int:
    """CUDA devices a scenario may place layers on: 0 where it computes on the CPU (pinned, forced, or
    no GPU), else what torch sees."""
    return visible_cuda_devices() if on_gpu() else 0


def memory_budget(budget: int) -> Dict[Any, int]:
    """A ``max_memory`` of ``budget`` bytes of memory where the scenario computes: all on the CPU there; on a
    GPU, half on the execution device and half on the CPU, so that what does not fit still goes to cpu and
    disk (a GPU/cpu/disk map, the seeds' placement)."""
    if not on_gpu():
        return {"cpu": budget}
    return {main_device(): budget // 2, "cpu": budget - budget // 2}


def to_device(value: Any) -> Any:
    """``value`` (a tensor, or a model) on the execution device."""
    return value.to(execution_device())


def pinned_reason() -> str:
    """Why this process computes on the CPU whatever the machine has ('' where it is not pinned)."""
    return os.environ.get(PIN_ENV, "")


def pin_environment(reason: str) -> Dict[str, str]:
    """The environment that pins a run to the CPU: CUDA hidden before torch looks, the reason recorded."""
    return dict(HIDDEN_CUDA, **{DEVICE_ENV: "cpu", PIN_ENV: reason or "pinned to the CPU"})


def report() -> Dict[str, Optional[str]]:
    """What the run's result records: the device it computed on (as decided, or ``cpu`` where pinned; None
    where the scenario never asked, e.g. it failed or was n/a first) and why it is pinned."""
    device = _decided or ("cpu" if pinned_reason() else None)
    return {"device": device, "device_note": pinned_reason() or None}


# -- what a process that may meet CUDA must not do --------------------------------------------------

def cuda_hidden(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``environ`` hides every CUDA device (set before torch initialises the driver)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def _simulated() -> str:
    return os.environ.get(SIMULATE_ENV, "").strip().lower()


def cuda_built() -> bool:
    """Whether the imported torch can use a GPU at all (a CUDA or ROCm build): with a CPU build, no
    import and no call initialises anything a fork could break."""
    if _simulated() in ("present", "initialised"):
        return True
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return bool(getattr(version, "cuda", None) or getattr(version, "hip", None))


def cuda_touched(maps: Optional[str] = None) -> str:
    """Why a child forked from this process could not use CUDA ('' where it could): torch initialised
    CUDA here, this process is itself such a fork, or the CUDA driver library is loaded (every
    initialisation, ``torch.cuda.is_available()``'s included, loads it first). ``maps``: this process's
    ``/proc/self/maps`` (tests). Where that cannot be read on a CUDA build, the answer errs on the side of
    not forking."""
    if _simulated() == "initialised":
        return f"CUDA initialised in this process (simulated: {SIMULATE_ENV}=initialised)"
    torch = sys.modules.get("torch")
    if torch is None or not cuda_built() or _simulated() == "present":
        return ""
    if getattr(torch.version, "hip", None):
        return "a ROCm build of torch: whether a fork can use the GPU is not checked"
    if torch.cuda.is_initialized():
        return "torch initialised CUDA in this process"
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if bad_fork is not None and bad_fork():
        return "this process was forked from one that initialised CUDA"
    if maps is None:
        try:
            with open("/proc/self/maps") as handle:
                maps = handle.read()
        except OSError:
            return "cannot tell whether the CUDA driver is loaded (no /proc/self/maps)"
    if re.search(r"/libcuda\.so", maps):
        return "the CUDA driver is loaded in this process (torch.cuda.is_available() or a CUDA call ran here)"
    return ""


def preload_plan(modules: Iterable[str], environ: Mapping[str, str] = os.environ) -> Tuple[List[str], Dict[str, str]]:
    """(the modules a warm parent may import before it forks, {left out: why}): where the imported torch
    can use a GPU that ``environ`` does not hide, modules that initialise CUDA at import stay out (each
    child imports them itself)."""
    kept: List[str] = []
    skipped: Dict[str, str] = {}
    may_meet_cuda = cuda_built() and not cuda_hidden(environ)
    for name in modules:
        root = name.partition(".")[0]
        if may_meet_cuda and root in CUDA_AT_IMPORT:
            skipped[name] = CUDA_AT_IMPORT[root]
        else:
            kept.append(name)
    return kept, skipped


def probe(workdir: Any) -> Dict[str, Any]:
    """A scenario function that reports where its run computes and what it was started with (the
    harness's tests run it through every path a scenario takes)."""
    return {"max_abs_diff": 0.0, "device": execution_device(), "pinned": pinned_reason(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
            "cuda_touched": cuda_touched(), "started_as": os.path.basename(sys.argv[0]),
            "bitsandbytes_imported": "bitsandbytes" in sys.modules}
