"""Ranks forked from the caller (metapatch.selftest._ranks): they form one real gloo group, start from a
fresh interpreter's process-wide state, are killed at the deadline, and fall back to fresh interpreters
where a fork would not be safe (CUDA touched in the caller among them). Each case runs in a subprocess of
its own, since a pytest(-xdist) worker has threads of its own and so never forks its ranks. The callers
start with CUDA hidden, as a scenario pinned to the CPU does, so the fork mechanics are the same on a GPU
machine; the ranks themselves always get CUDA hidden (gloo on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

REPO = Path(__file__).resolve().parents[1]

# Set by the caller only: a forked rank sees it, a fresh interpreter does not.
CALLER_MARK = None


def _group_rank(rank, world_size, workdir):
    import threading

    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # a fresh PartialState sees WORLD_SIZE=2, whatever the caller built
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {"sum": float(value), "cwd": os.getcwd(), "mark": CALLER_MARK, "env_rank": os.environ["RANK"],
            "num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
            "threads": threading.active_count(), "draw": float(torch.rand(1)),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda": torch.cuda.is_available()}


def _sleeping_rank(rank, world_size, workdir):
    import time

    time.sleep(600)


def _run(body: str, tmp_path: Path, **env: str) -> dict:
    """Run ``body`` (which sets ``out``) in a fresh interpreter that imported this module as the caller
    would, with one intra-op thread (what the selftest runs use)."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}]
        import torch, metapatch
        import test_forked_ranks as here
        from metapatch.selftest._ranks import run_ranks, _can_fork
        here.CALLER_MARK = "caller"
        workdir = {str(tmp_path)!r}
    """) + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    from metapatch.selftest._device import HIDDEN_CUDA

    child_env = dict(os.environ, OMP_NUM_THREADS="1", **{**HIDDEN_CUDA, **env})
    # A rank started as a fresh interpreter imports this module by name.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    child_env.pop("METAPATCH_DISABLE", None)
    done = subprocess.run([sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_forked_ranks_form_one_group_from_fresh_state(tmp_path):
    out = _run("""
        from accelerate import PartialState
        from tqdm.auto import tqdm
        PartialState()  # a single-process state the ranks must not inherit
        for _ in tqdm(range(2), mininterval=0):  # starts tqdm's monitor thread: stopped for the fork
            pass
        torch.manual_seed(0)
        reports = run_ranks("test_forked_ranks:_group_rank", workdir)
        out = {"reports": [r.get("result") or r for r in reports], "caller_draw": float(torch.rand(1))}
    """, tmp_path)
    results = out["reports"]
    assert all("sum" in r for r in results), results
    assert [r["mark"] for r in results] == ["caller", "caller"]  # forked, not fresh interpreters
    assert [(r["cuda_visible_devices"], r["cuda"]) for r in results] == [("", False), ("", False)]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert [r["env_rank"] for r in results] == ["0", "1"]
    assert [(r["num_processes"], r["process_index"]) for r in results] == [(2, 0), (2, 1)]
    assert {r["cwd"] for r in results} == {str(tmp_path)}
    # Each rank draws from a fresh nondeterministic seed, as a new interpreter does, not the caller's stream.
    assert len({r["draw"] for r in results} | {out["caller_draw"]}) == 3


def test_ranks_start_fresh_interpreters_where_forking_is_off_or_unsafe(tmp_path):
    off = _run("""
        reports = run_ranks("test_forked_ranks:_group_rank", workdir)
        out = [r["result"]["mark"] for r in reports]
    """, tmp_path, METAPATCH_SELFTEST_FORK="0")
    assert off == [None, None]
    busy = _run("""
        import threading
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()  # a thread of the caller's own
        assert not _can_fork()
        reports = run_ranks("test_forked_ranks:_group_rank", workdir)
        stop.set()
        out = [r["result"]["mark"] for r in reports]
    """, tmp_path)
    assert busy == [None, None]
    threads = _run("""
        torch.set_num_threads(2)  # an intra-op pool: not forked
        out = _can_fork()
    """, tmp_path)
    assert threads is False


def test_ranks_never_fork_from_a_caller_that_touched_cuda(tmp_path):
    """A caller in which CUDA was initialised (simulated: what the fork rule reads) starts fresh interpreters,
    and every rank runs with CUDA hidden even where the caller sees a GPU."""
    out = _run("""
        reports = run_ranks("test_forked_ranks:_group_rank", workdir)
        out = {"forked": _can_fork(), "results": [r.get("result") or r for r in reports]}
    """, tmp_path, METAPATCH_SELFTEST_SIMULATE_CUDA="initialised", CUDA_VISIBLE_DEVICES="0",
        PYTORCH_NVML_BASED_CUDA_CHECK="")
    assert out["forked"] is False
    results = out["results"]
    assert [r["mark"] for r in results] == [None, None], results  # fresh interpreters
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert [(r["cuda_visible_devices"], r["cuda"]) for r in results] == [("", False), ("", False)]


def test_forked_ranks_are_killed_at_the_deadline(tmp_path):
    out = _run("""
        import time
        started = time.monotonic()
        reports = run_ranks("test_forked_ranks:_sleeping_rank", workdir, timeout=3)
        out = {"seconds": time.monotonic() - started, "types": [r["error_type"] for r in reports],
               "forked": _can_fork()}
    """, tmp_path)
    assert out["forked"] is True
    assert out["types"] == ["TimeoutExpired", "TimeoutExpired"]
    assert out["seconds"] < 30
