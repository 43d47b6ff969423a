"""Runs the legs not yet in the cache, one process each, and reports progress on stderr."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from metapatch.sweep import LEGS, REPO


def result_path(stack_dir: Path, arch: str, leg: str) -> Path:
    return stack_dir / f"{arch}.{leg}.json"


def load(stack_dir: Path, arch: str, leg: str, key: Optional[str]) -> Optional[Dict[str, Any]]:
    """The cached result of a leg, or None when absent or run with other code (``key``)."""
    path = result_path(stack_dir, arch, leg)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if key is not None and key.endswith("*"):
        if not str(result.get("key", "")).startswith(key[:-1]):
            return None
    elif key is not None and result.get("key") != key:
        return None
    return result


def _env(leg: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("METAPATCH_DISABLE", None)
    if leg == "unpatched":
        env["METAPATCH_DISABLE"] = "all"
    return env


def run_leg(arch: str, model_type: str, leg: str, key: str, stack_dir: Path, timeout: float,
            python: str = sys.executable) -> Dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"metapatch-sweep-{arch}-{leg}-"))
    out = workdir / "result.json"
    log = workdir / "log.txt"
    started = time.perf_counter()
    try:
        with open(log, "wb") as handle:
            try:
                code = subprocess.run([python, "-m", "metapatch.sweep.child", arch, model_type, leg, str(workdir),
                                       str(out)], cwd=workdir, env=_env(leg), stdout=handle, stderr=subprocess.STDOUT,
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = None
        try:
            result = json.loads(out.read_text())
        except (OSError, ValueError):
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            reason = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
            result = {"arch": arch, "model_type": model_type, "leg": leg,
                      "crash": {"type": "ProcessDied", "message": f"{reason}: {' | '.join(tail)}"[:300], "where": ""}}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["key"] = key
    result["wall_s"] = round(time.perf_counter() - started, 2)
    stack_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(stack_dir, arch, leg)
    path.with_suffix(".tmp").write_text(json.dumps(result, indent=1, sort_keys=True))
    os.replace(path.with_suffix(".tmp"), path)
    return result


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def run_all(archs: List[Tuple[str, str]], keys: Dict[str, Dict[str, str]], stack_dir: Path, timeout: float,
            jobs: int, legs: Tuple[str, ...] = LEGS, log: Callable[[str], None] = print,
            stamp: Optional[Dict[str, Dict[str, str]]] = None) -> float:
    """Run every (architecture, leg) missing from the cache (``keys[arch][leg]`` as for :func:`load`); the
    new results are stamped with ``stamp[arch][leg]`` (default ``keys``). Returns the wall time spent."""
    todo = [(arch, model_type, leg) for arch, model_type in archs for leg in legs
            if load(stack_dir, arch, leg, keys[arch][leg]) is None]
    cached = len(archs) * len(legs) - len(todo)
    log(f"sweep: {len(archs)} architectures x {len(legs)} legs: {cached} cached, {len(todo)} to run "
        f"({jobs} at a time); results in {stack_dir}")
    started = time.perf_counter()
    done = 0

    def one(item: Tuple[str, str, str]) -> Tuple[Tuple[str, str, str], Dict[str, Any]]:
        arch, model_type, leg = item
        return item, run_leg(arch, model_type, leg, (stamp or keys)[arch][leg], stack_dir, timeout)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for (arch, _, leg), result in pool.map(one, todo):
            done += 1
            elapsed = time.perf_counter() - started
            eta = elapsed / done * (len(todo) - done)
            states = [row.get("status", "?") for row in result.get("placements", {}).values()]
            summary = ("build/run failed" if not states
                       else ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states))))
            flow_states = [row.get("status", "?") for row in result.get("flows", {}).values()]
            if flow_states:
                summary += "; flows " + ", ".join(f"{flow_states.count(s)} {s}" for s in sorted(set(flow_states)))
            bar = "#" * int(20 * done / len(todo))
            log(f"[{bar:<20}] {done}/{len(todo)} {arch} {leg}: {summary} ({result['wall_s']:.0f} s) "
                f"elapsed {_clock(elapsed)}, eta {_clock(eta)}")
    return time.perf_counter() - started
