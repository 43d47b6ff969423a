"""Run a function as N ranks of one process group, as ``torchrun`` would, and bring each rank's result
back to the caller.

Each rank is a fresh interpreter (``python -m metapatch.selftest._ranks FUNCTION RANK ...``) with
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and the
caller's environment (``METAPATCH_DISABLE`` and ``PYTHONPATH`` included, so the three legs of a proof
reach the ranks unchanged). Plain subprocesses rather than ``torch.multiprocessing.spawn``: a spawned
child re-imports the parent's ``__main__`` (the selftest zygote, pytest) and has no timeout; here the
whole group is killed at the deadline and the caller gets a per-rank report either way.

Where it is safe, the ranks are forked from the caller instead (:func:`_can_fork`): a scenario's process
has already imported torch, the stack and metapatch, and a fresh interpreter per rank spent most of a
two-rank scenario's time importing them again. Safe means what the selftest's warm parent relies on
too: one thread in the process, one intra-op thread in torch (an OpenMP pool does not survive a
fork), CUDA untouched in the caller (``_device.cuda_touched``: not initialised, the driver not even
loaded, as ``torch.cuda.is_available()`` loads it), no process group yet, and no environment of the
caller's own (``env``), which a rank would have had to read at import time. ``METAPATCH_SELFTEST_FORK=0``
turns it off.

The ranks compute on the CPU over gloo unless the caller asks for GPUs (``gpus=True``): CUDA is hidden
from each rank's environment (``_device.HIDDEN_CUDA``) before its torch looks, so a rank never maps itself
to ``cuda:RANK`` on a machine with fewer GPUs than ranks. With ``gpus=True`` a rank sees the machine's
GPUs and :func:`backend` picks nccl only where every rank has one.

The rank function is ``module:function`` called as ``function(rank, world_size, workdir)``; it
initialises its own process group (``init_process_group`` or an accelerate ``Accelerator``; the
backend is gloo on CPU, nccl where each rank has a GPU: :func:`backend`) and returns a dict that
``torch.save`` can write (tensors, numbers, strings). Its exception is the rank's result, not a crash.

Accelerate on CPU: ``AcceleratorState`` decides ``MULTI_CPU`` (DDP) whenever the device is CPU and
``WORLD_SIZE > 1``, even with ``ACCELERATE_USE_FSDP=true``, and drops the FSDP plugin, so an FSDP test
on CPU would silently test DDP (without ``cpu=True`` it is worse: ``DistributedType.NO`` and every
rank its own main process). The ranks here use :func:`fsdp_accelerator`, which builds the
``Accelerator`` with ``cpu=True`` and then sets ``state.distributed_type = DistributedType.FSDP`` and
``state.fsdp_plugin`` (what a GPU run decides), in ``PartialState``'s shared state as well: each
``AcceleratorState()`` construction (``from_pretrained`` and ``Trainer`` make them) copies that one
over its own, which is how the type silently went back to ``MULTI_CPU`` after the first load. That is test-harness code: no shipped patch changes accelerate's
choice.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
}


_GRACE_S = 10.0

# What a scenario that runs ranks declares (``Scenario(..., **GLOO_RANKS)``): it computes on the CPU on
# every machine, its process and ranks started with CUDA hidden (see _device).
GLOO_RANKS = {"device": "cpu", "device_reason": "two ranks over gloo, one CPU process each (a GPU per rank needs "
                                                "as many GPUs as ranks, and nccl)"}
# What a scenario whose ranks run FSDP2 (``fully_shard``) on the CPU requires besides: torch 2.7, whose CPU stream
# has ``record_event`` (pytorch#145935); on torch 2.6 FSDP2's first all-gather fails on the CPU, with and without
# metapatch ("'Stream' object has no attribute 'record_event'"), so the scenario cannot show its bug there.
FSDP2_ON_CPU = {"torch": ">=2.7"}
# And where the ranks take a training step: before torch 2.9 FSDP2's step on the CPU over gloo is wrong on every rank
# even for a model without ties (measured: an untied Llama's logits after one SGD step 1.49 off one process's on
# torch 2.7.1 and 2.8.0, equal on 2.9.0, 2.10.0, 2.11.0 and 2.13.0; most likely pytorch#162338, gloo summing
# what FSDP2 asks it to average, not verified further), so no bug of metapatch's could be told apart.
FSDP2_TRAINING_ON_CPU = {"torch": ">=2.9"}


def _ok(workdir: Path, rank: int) -> bool:
    import torch

    path = workdir / f"rank{rank}.pt"
    return path.exists() and bool(torch.load(path, weights_only=False).get("ok"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "gloo"


# A hang guard, under the selftest's 300 s a scenario: two ranks on a loaded 2-core machine took up to ~150 s.
RANK_TIMEOUT_S = 280.0


def run_ranks(function: str, workdir: Path, *, world_size: int = 2, timeout: float = RANK_TIMEOUT_S,
              env: Optional[Mapping[str, str]] = None, gpus: bool = False) -> List[Dict[str, Any]]:
    """Run ``function`` as ``world_size`` ranks; one report per rank, in rank order:
    ``{"rank", "ok", "result"}`` or ``{"rank", "ok": False, "error_type", "error", "traceback"}``.
    ``gpus``: the ranks see the machine's CUDA devices (default: hidden, gloo on the CPU)."""
    import torch

    from ._device import HIDDEN_CUDA

    workdir = Path(workdir)
    here = str(Path(__file__).resolve().parents[2])
    base = dict(os.environ)
    base.update(env or {})
    if not gpus:
        base.update(HIDDEN_CUDA)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (base.get("PYTHONPATH", ""), here) if p)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"))
    fork = env is None and _can_fork()
    procs = []
    for rank in range(world_size):
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        log = open(workdir / f"rank{rank}.log", "w")
        if fork:
            procs.append((_ForkedRank(function, rank, world_size, workdir, rank_env, log), log))
            continue
        procs.append((subprocess.Popen([sys.executable, "-m", "metapatch.selftest._ranks", function, str(rank),
                                        str(world_size), str(workdir)], env=rank_env, cwd=str(workdir),
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    failed_at = None
    finished: Dict[int, bool] = {}
    while any(proc.poll() is None for proc, _ in procs):
        now = time.monotonic()
        if now > deadline:
            timed_out = True
            break
        for r, (proc, _) in enumerate(procs):
            if r not in finished and proc.poll() is not None:
                finished[r] = proc.returncode == 0 and _ok(workdir, r)
                if not finished[r] and failed_at is None:
                    failed_at = now
        # A failed rank leaves the others blocked in a collective until the deadline: give them a
        # grace period to report their own error, then stop waiting.
        if failed_at is not None and now - failed_at > _GRACE_S:
            timed_out = True
            break
        time.sleep(0.05)
    for proc, log in procs:  # one rank failing leaves the others waiting in a collective
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    reports = []
    for rank, (proc, _) in enumerate(procs):
        path = workdir / f"rank{rank}.pt"
        if path.exists():
            reports.append(torch.load(path, weights_only=False))
        else:
            tail = (workdir / f"rank{rank}.log").read_text(errors="replace")[-3000:]
            reports.append({"rank": rank, "ok": False,
                            "error_type": "TimeoutExpired" if timed_out else "RankCrashed",
                            "error": f"exit code {proc.returncode}, no result" + (f" after {timeout} s" if timed_out else ""),
                            "traceback": tail})
    return reports


def _can_fork() -> bool:
    """Whether a rank may be a fork of this process (see the module docstring)."""
    from ._device import cuda_touched

    if os.environ.get("METAPATCH_SELFTEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return False
    _stop_progress_monitors()
    if threading.active_count() != 1 or "torch" not in sys.modules:
        return False
    import torch

    if torch.get_num_threads() != 1 or cuda_touched():
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _stop_progress_monitors() -> None:
    """Stop tqdm's monitor thread (started by the first progress bar of a load, e.g. a checkpoint's
    shards): a thread that may hold tqdm's lock at the fork would deadlock a rank's first bar. tqdm starts
    a new one with its next bar, in the caller and in each rank."""
    for thread in threading.enumerate():
        if type(thread).__module__ == "tqdm._monitor":
            thread.exit()
            if getattr(thread.tqdm_cls, "monitor", None) is thread:
                thread.tqdm_cls.monitor = None


def _as_fresh_interpreter() -> None:
    """What a forked rank inherited that a fresh interpreter would not have: the caller's random state and
    accelerate's process-wide state (a caller that built a model made a single-process ``PartialState``,
    which every ``Accelerator`` of the rank would otherwise reuse)."""
    import torch

    torch.seed()  # a fresh interpreter's generator starts from a nondeterministic seed: so does each rank
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


class _ForkedRank:
    """A rank forked from the caller, with the ``poll``/``kill``/``wait``/``returncode`` of a Popen."""

    def __init__(self, function: str, rank: int, world_size: int, workdir: Path, env: Mapping[str, str],
                 log: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: Optional[int] = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.chdir(workdir)
                os.environ.clear()
                os.environ.update(env)
                _as_fresh_interpreter()
                code = _main(function, str(rank), str(world_size), str(workdir))
            except BaseException:  # noqa: BLE001 - reported through the missing result file
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def raise_first_error(reports: List[Dict[str, Any]]) -> None:
    """Re-raise a failing rank's error in the caller, with its class name kept, so a scenario fails
    the way the rank failed (the harness reports ``error_type``): the rank's own error before a
    peer's "connection reset" or a crash without a result."""
    def secondary(report: Dict[str, Any]) -> bool:  # a peer's crash seen from a healthy rank
        return report["error_type"] in ("RankCrashed", "TimeoutExpired") or "gloo" in report.get("error", "")

    for report in sorted((r for r in reports if not r["ok"]), key=secondary):
        error_class = type(report["error_type"], (RuntimeError,), {})
        raise error_class(f"rank {report['rank']}: {report['error']}\n{report.get('traceback', '')[-2000:]}")


def fsdp_accelerator(**kwargs: Any) -> Any:
    """An ``Accelerator`` whose state says FSDP on CPU too (see the module docstring): the plugin
    is built from FSDP_ENV (put it in the environment first), the state, which dropped it when it
    chose DDP, gets it back together with ``DistributedType.FSDP``. ``AcceleratorState`` is a shared
    state: every later ``AcceleratorState()`` sees the corrected values."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = kwargs.pop("fsdp_plugin", None) or FullyShardedDataParallelPlugin()
    # Without cpu=True a GPU-less machine gets DistributedType.NO and every rank believes it is
    # the main process (num_processes 1); with it, MULTI_CPU, i.e. DDP.
    kwargs.setdefault("cpu", backend() == "gloo")
    accelerator = Accelerator(fsdp_plugin=plugin, **kwargs)
    # Every AcceleratorState() construction copies PartialState's shared state over its own
    # (from_pretrained and Trainer construct one), so the correction goes into both.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _main(function: str, rank: str, world_size: str, workdir: str) -> int:
    import torch

    result: Dict[str, Any] = {"rank": int(rank), "ok": False}
    try:
        module_name, _, name = function.partition(":")
        func = getattr(importlib.import_module(module_name), name)
        result["result"] = func(int(rank), int(world_size), Path(workdir))
        result["ok"] = True
    except BaseException as exc:  # the rank's failure is its result
        result.update(error_type=type(exc).__name__, error=str(exc)[:2000],
                      traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-6000:])
    torch.save(result, Path(workdir) / f"rank{rank}.tmp")
    os.replace(Path(workdir) / f"rank{rank}.tmp", Path(workdir) / f"rank{rank}.pt")
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is written; teardown must not change it
        pass
    return 0


if __name__ == "__main__":
    import metapatch  # noqa: F401 - inert under METAPATCH_DISABLE=all, active otherwise

    sys.exit(_main(*sys.argv[1:5]))
