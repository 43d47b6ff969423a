"""The two-rank runner the FSDP scenarios use (metapatch.selftest._ranks): ranks really form one process group
(gloo on CPU), and a failing rank is reported with its own error, not waited for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metapatch.selftest._ranks import raise_first_error, run_ranks

pytestmark = pytest.mark.ranks

# The ranks import this module by its name: its folder goes on their path.
HERE_ON_PATH = {"PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)}


def _sum_of_ranks(rank, world_size, workdir):
    import torch
    import torch.distributed as dist

    from metapatch.selftest._ranks import backend

    dist.init_process_group(backend())
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {"sum": float(value), "cwd": os.getcwd()}


def _rank1_fails(rank, world_size, workdir):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        raise KeyError("rank one's own error")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: the harness must not wait for its timeout


def test_ranks_form_one_group(tmp_path):
    reports = run_ranks(f"{__name__}:_sum_of_ranks", tmp_path, timeout=600, env=HERE_ON_PATH)
    raise_first_error(reports)
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["result"]["sum"] for r in reports] == [3.0, 3.0]  # 1 + 2, seen by both
    assert {r["result"]["cwd"] for r in reports} == {str(tmp_path)}


def test_failing_rank_is_reported_with_its_error(tmp_path):
    reports = run_ranks(f"{__name__}:_rank1_fails", tmp_path, timeout=600, env=HERE_ON_PATH)
    assert reports[1]["ok"] is False and reports[1]["error_type"] == "KeyError"
    assert reports[0]["ok"] is False
    with pytest.raises(Exception) as raised:
        raise_first_error(reports)
    assert type(raised.value).__name__ == "KeyError" and "rank 1" in str(raised.value)
