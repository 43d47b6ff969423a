#!/usr/bin/env python3
"""The GPU lane: metapatch's checks on a machine with CUDA, in one short run, from wheels prepared beforehand.

    python3 .ci/gpu_lane.py prepare            # here, with network: the wheels into .gpu/whl (ignored by git)
    python3 .ci/gpu_lane.py run --out DIR      # there, without network: install, run, summarize (<= --budget s)
    python3 .ci/gpu_lane.py run --dry-run      # no GPU: every step that can run on the CPU, GPU-only ones skipped

``prepare`` downloads the matrix pair and what it needs beyond what the GPU image already has (its torch,
pytest, xdist and pytest-timeout stay) as binary wheels for CPython 3.12 on manylinux x86-64, and trims
bitsandbytes to its CPU library and the CUDA 13.0 one the image's torch uses. ``run`` extracts the wheels that
fit the interpreter (Python's zipfile: the image has no unzip) into a site folder put first on PYTHONPATH,
sets ``USE_HUB_KERNELS=0`` (transformers 5.25 with ``kernels`` installed fails every CUDA load offline
otherwise), ``HF_HUB_OFFLINE=1`` and ``OMP_NUM_THREADS=1``, and runs, each step with its own timeout and a
share of the time budget, its output under ``--out`` (at most 8 files):

  env        versions, ``nvidia-smi``, the CUDA devices                         env.txt
  gpu-tests  the ``gpu``-marked tests                                          tests.log
  selftest   ``metapatch selftest --json --all`` (records each scenario's device) selftest.json
  three-way  the device-parametrized three-way scenarios, on cuda:0            tests.log
  bench      benchmarks/bench_gpu_offload.py --quick                           bench.json
  suite      the rest of the suite with CUDA visible (-n 15), with the time left  suite.log
             (stopped with SIGINT at its deadline: what finished is counted)
  summary    summary.json (counts per step, failures, the markdown block for docs/gpu-runs.md) and summary.md;
             lane.log is the lane's own log. The summary is rewritten after every step.

Without CUDA (or with ``--dry-run``) the same steps run on the CPU, except the GPU-only ones (gpu-tests, and
three-way's cuda:0 leg), which are reported ``skipped``, never ``passed``; ``--smoke`` shrinks every step to
its smallest selection (what CI runs, tests/test_gpu_lane.py). A step stopped by its cap or by what is left
of the budget is ``partial`` (what it finished is counted); ``failed`` means a test, scenario or command
failed. Exit status: 0 when no step failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu" / "whl"
# What the GPU image lacks or has too old (it has torch 2.11.0+cu130, transformers 5.17.0, accelerate 1.15.0,
# pytest, pytest-xdist, pytest-timeout; no bitsandbytes, no unzip): the latest matrix pair and the hub client
# transformers 5.25 needs, with that client's own new dependencies. One version each: a lane run is repeatable.
PINS = (
    "transformers==5.25.0", "accelerate==1.16.0", "peft==0.22.0", "bitsandbytes==0.50.2", "kernels==0.19.1",
    "huggingface_hub==2.4.0", "httpx2==2.16.2", "httpcore2==2.16.2", "hf-xet==1.8.0", "click==8.4.2",
    "idna==3.18", "anyio==4.16.0", "truststore==0.10.5", "tomlkit==0.15.3", "gguf==0.19.0", "parameterized==0.9.0",
)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64")
BNB_LIBRARIES = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so")  # the image's torch is built for CUDA 13.0
# Not in the time-boxed suite: the upstream suites, the sweep and the standalone reproducers (minutes each,
# none about the device), and the lane's own CPU dry run.
SUITE_IGNORED = ("tests/test_upstream_suites.py", "tests/test_sweep.py", "tests/test_reproducers.py",
                 "tests/test_series_reproducers.py", "tests/test_gpu_lane.py")  # the last: this lane's own dry run
# Three-way files run first, on cuda:0 (their scenarios take the execution device as a parameter): the 4-bit
# flows with layers on cpu and disk, the model-device flows, and the pipeline's device (its cpu-first map
# sends inputs to the CPU unpatched only where a GPU computes: measured nowhere else). The suite step runs the
# other ones, with the time it has.
THREE_WAY = ("tests/patches/test_transformers_quantized_disk_weights.py", "tests/patches/test_bnb_quant_state_offload.py",
             "tests/patches/test_offloaded_model_device.py", "tests/patches/test_gemma4_offloaded_embeddings.py",
             "tests/patches/test_transformers_pipeline_offloaded_device.py",
             "tests/patches/test_offloaded_placeholder_writes.py::TestThreeWay")
STEP_CAPS = {"env": 30, "gpu-tests": 75, "selftest": 70, "three-way": 75, "bench": 70}
RESERVE_S = 12  # kept at the end for the summary (smoke: 4)
STOP_GRACE_S = 10  # between a pytest step's SIGINT at its deadline and the SIGKILL of what is left
ENV = {"USE_HUB_KERNELS": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1", "METAPATCH_STRICT": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


# ---------------------------------------------------------------------------------------------------------
# prepare (the CPU machine, with network)


def trim_bitsandbytes(wheel: Path) -> List[str]:
    """Rewrite the bitsandbytes wheel without the native libraries the lane never loads (one per CUDA
    version: most of its size); returns what was dropped."""
    dropped: List[str] = []
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            name = item.filename.rsplit("/", 1)[-1]
            if name.startswith("libbitsandbytes") and name not in BNB_LIBRARIES:
                dropped.append(name)
                continue
            target.writestr(item, source.read(item.filename))
    trimmed.replace(wheel)
    return dropped


def prepare(dest: Path, python_version: str = "3.12") -> int:
    dest.mkdir(parents=True, exist_ok=True)
    abi = "cp" + python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
               "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
               "--abi", "none"]
    for platform_tag in PLATFORMS:
        command += ["--platform", platform_tag]
    subprocess.run([*command, *PINS], check=True)
    for wheel in dest.glob("bitsandbytes-*.whl"):
        dropped = trim_bitsandbytes(wheel)
        print(f"{wheel.name}: kept {', '.join(BNB_LIBRARIES)}; dropped {len(dropped)} other libraries")
    names = sorted(p.name for p in dest.glob("*.whl"))
    missing = [pin for pin in PINS if not any(n.lower().startswith(pin.split("==")[0].replace("-", "_").lower() + "-")
                                              for n in names)]
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"{len(names)} wheels in {dest} ({size:.1f} MiB)" + (f"; MISSING: {missing}" if missing else ""))
    return 1 if missing else 0


# ---------------------------------------------------------------------------------------------------------
# install (the GPU machine, without network)


def wheel_fits(name: str, supported: Optional[set] = None) -> bool:
    """Whether a wheel's tags fit the running interpreter (a cp312 wheel is skipped under 3.11)."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:  # an interpreter without packaging: every wheel, as the lane was prepared for it
        return True

    supported = supported if supported is not None else set(sys_tags())
    return any(tag in supported for tag in parse_wheel_filename(name)[3])


def install(wheels: Path, site: Path, log: Any) -> Dict[str, Any]:
    """Extract every wheel that fits this interpreter into ``site`` (first on PYTHONPATH from now on), and
    metapatch's own metadata, so that version look-ups and the ``metapatch`` command find it."""
    site.mkdir(parents=True, exist_ok=True)
    extracted, skipped = [], []
    for wheel in sorted(wheels.glob("*.whl")):
        if not wheel_fits(wheel.name):
            skipped.append(wheel.name)
            continue
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
        extracted.append(wheel.name)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    info = site / f"metapatch-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: metapatch\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nmetapatch = metapatch.cli:main\n")
    print(f"install: {len(extracted)} wheels into {site}" + (f"; not for this interpreter: {skipped}" if skipped else ""),
          file=log, flush=True)
    return {"extracted": extracted, "not_for_this_interpreter": skipped}


# ---------------------------------------------------------------------------------------------------------
# pytest: one JSON line per finished test, written by the controller (so a run stopped at its deadline
# still says what finished). Loaded with ``-p gpu_lane`` (this module) where GPU_LANE_REPORT is set.


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("GPU_LANE_REPORT")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    row = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "xfail": bool(getattr(report, "wasxfail", False))}
    if report.failed:
        text = str(getattr(report, "longreprtext", "") or "")
        row["error"] = (text.strip().splitlines() or [""])[-1][:300]
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


def outcomes_of(report_path: Path) -> Dict[str, Any]:
    """Per test: failed (any phase), error (setup/teardown failed), skipped, xfailed, passed."""
    final: Dict[str, str] = {}
    errors: Dict[str, str] = {}
    if report_path.exists():
        for line in report_path.read_text().splitlines():
            row = json.loads(line)
            node, when, outcome = row["nodeid"], row["when"], row["outcome"]
            if outcome == "failed":
                final[node] = "failed" if when == "call" else "error"
                errors[node] = row.get("error", "")
            elif outcome == "skipped" and final.get(node) not in ("failed", "error"):
                final[node] = "xfailed" if row.get("xfail") else "skipped"
            elif outcome == "passed" and when == "call" and node not in final:
                final[node] = "xpassed" if row.get("xfail") else "passed"
    counts: Dict[str, Any] = {}
    for outcome in final.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    failures = [f"{node}: {errors.get(node, '')}" for node, outcome in final.items() if outcome in ("failed", "error")]
    return {"counts": counts, "failures": failures[:40]}


# ---------------------------------------------------------------------------------------------------------
# run


class Lane:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu-lane-"))
        self.log = open(self.out / "lane.log", "a")
        self.steps: List[Dict[str, Any]] = []
        # A lane started from inside a pytest-xdist worker (its CPU dry-run test) must not hand the worker's
        # PYTEST_XDIST_* / PYTEST_CURRENT_TEST to the pytest runs it starts: they then report nothing.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        self.python = args.python or sys.executable
        self.cuda = False
        self.facts: Dict[str, Any] = {}
        self.reserve = 4 if args.smoke else RESERVE_S

    # -- time ---------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started) - self.reserve

    def timeout_for(self, name: str) -> float:
        cap = STEP_CAPS.get(name, self.args.budget)
        return max(0.0, min(cap, self.left()))

    def stopped_by(self, name: str, timeout: float) -> str:
        """Why a step that timed out was stopped: what was left of the lane's budget, or its own cap (the
        share the lane plans for it). Either way what it finished counts, and it is partial, not failed."""
        if name == "suite" or timeout < STEP_CAPS.get(name, self.args.budget) - 1:
            return f"cut by the lane's budget at {timeout:.0f} s"
        return f"stopped at its cap of {timeout:.0f} s"

    def say(self, text: str) -> None:
        stamp = f"[{time.monotonic() - self.started:6.1f}s]"
        print(f"{stamp} {text}", file=self.log, flush=True)
        print(f"{stamp} {text}", flush=True)

    # -- processes ----------------------------------------------------------------------------------
    def execute(self, command: Sequence[str], timeout: float, output: Path, env: Optional[Dict[str, str]] = None,
                graceful: bool = False) -> Dict[str, Any]:
        """Run ``command`` in its own process group, its output appended to ``output``; at ``timeout``
        SIGINT (``graceful``: pytest then stops and reports) and, STOP_GRACE_S later or at once, SIGKILL the group."""
        started = time.monotonic()
        with open(output, "a") as sink:
            sink.write(f"\n$ {' '.join(command)}\n")
            sink.flush()
            process = subprocess.Popen(list(command), cwd=str(ROOT), env=env or self.env, stdout=sink,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                process.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                timed_out = True
                if graceful:
                    os.killpg(process.pid, signal.SIGINT)
                    try:
                        process.wait(timeout=STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        pass
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            try:  # scenario children of a killed run must not outlive it
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return {"rc": process.returncode, "timed_out": timed_out, "seconds": round(time.monotonic() - started, 1)}

    def record(self, name: str, status: str, **fields: Any) -> Dict[str, Any]:
        step = {"name": name, "status": status, **fields}
        self.steps.append(step)
        self.say(f"{name}: {status}" + (f" {fields.get('counts')}" if fields.get("counts") else "")
                 + (f" ({fields['note']})" if fields.get("note") else ""))
        self.write_summary()
        return step

    def skip(self, name: str, why: str) -> None:
        self.record(name, "skipped", note=why, seconds=0)

    def pytest(self, name: str, arguments: Sequence[str], output: Path, workers: int,
               extra_env: Optional[Dict[str, str]] = None) -> None:
        # the time box, less the grace between SIGINT and SIGKILL: the step ends within its share
        timeout = (self.timeout_for(name) if name != "suite" else max(0.0, self.left())) - STOP_GRACE_S
        if timeout < 10:
            return self.skip(name, "no time left in the budget")
        report = self.scratch / f"{name}.jsonl"
        env = dict(self.env, GPU_LANE_REPORT=str(report), **(extra_env or {}))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / ".ci"), env.get("PYTHONPATH", "")])
        command = [self.python, "-m", "pytest", "-p", "gpu_lane", "-p", "no:cacheprovider", "-q", "-rfE",
                   "-o", "addopts=", *(["-n", str(workers), "--dist", "loadfile"] if workers > 1 else ["-n", "0"])]
        if self.has_module("pytest_timeout"):
            command += ["--timeout", str(int(min(timeout, 300)))]
        ran = self.execute([*command, *arguments], timeout, output, env, graceful=True)
        found = outcomes_of(report)
        counts = found["counts"]
        if ran["timed_out"]:
            status = "failed" if counts.get("failed") or counts.get("error") else "partial"
            note = self.stopped_by(name, timeout + STOP_GRACE_S) + ": the counts are what finished"
        elif ran["rc"] in (0, 5) and not counts.get("failed") and not counts.get("error"):
            status = "passed" if counts.get("passed") else "skipped"
            note = "" if counts.get("passed") else "nothing ran"
        else:
            status = "failed"
            note = f"pytest exit code {ran['rc']}"
        self.record(name, status, counts=counts, failures=found["failures"], seconds=ran["seconds"], note=note)

    def has_module(self, module: str) -> bool:
        probe = subprocess.run([self.python, "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec({module!r}) is None)"],
                               env=self.env, capture_output=True)
        return probe.returncode == 0

    # -- steps --------------------------------------------------------------------------------------
    def step_install(self) -> None:
        started = time.monotonic()
        site = Path(self.args.site).resolve() if self.args.site else self.scratch / "site"
        bin_dir = self.scratch / "bin"
        bin_dir.mkdir(exist_ok=True)
        wheels = Path(self.args.wheels).resolve()
        if any(wheels.glob("*.whl")):
            result = install(wheels, site, self.log)
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            note = f"{len(result['extracted'])} wheels from {wheels.name}/"
            if result["not_for_this_interpreter"]:
                note += f"; not for this interpreter: {', '.join(result['not_for_this_interpreter'])}"
        elif self.args.dry_run or self.args.smoke:
            self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            note = f"no wheels in {wheels}: the installed stack"
        else:
            self.record("install", "failed", note=f"no wheels in {wheels} (run `python3 .ci/gpu_lane.py prepare` "
                        "where there is network, and carry .gpu)", seconds=0)
            raise SystemExit(1)
        launcher = bin_dir / "metapatch"
        launcher.write_text(f"#!/bin/sh\nexec {self.python} -m metapatch.cli \"$@\"\n")
        launcher.chmod(0o755)
        self.env["PATH"] = os.pathsep.join([str(bin_dir), self.env.get("PATH", "")])
        self.env.update(ENV)
        self.env.setdefault("HF_HOME", str(self.scratch / "hf-home"))
        self.record("install", "passed", note=note, seconds=round(time.monotonic() - started, 1))

    def step_env(self) -> None:
        output = self.out / "env.txt"
        probe = ("import metapatch, json, platform, torch, importlib.metadata as m\n"
                 "def v(d):\n    try: return m.version(d)\n    except Exception: return None\n"
                 "cuda = torch.cuda.is_available()\n"
                 "print('LANE-ENV ' + json.dumps({'python': platform.python_version(), 'torch': torch.__version__,"
                 " 'cuda': cuda, 'cuda_version': torch.version.cuda, 'devices': torch.cuda.device_count() if cuda else 0,"
                 " 'gpu': torch.cuda.get_device_name(0) if cuda else '', 'transformers': v('transformers'),"
                 " 'accelerate': v('accelerate'), 'peft': v('peft'), 'bitsandbytes': v('bitsandbytes'),"
                 " 'kernels': v('kernels'), 'huggingface_hub': v('huggingface_hub'), 'metapatch': v('metapatch')}))\n"
                 "import transformers, accelerate, peft, bitsandbytes\n"
                 "print('imports ok: metapatch from', metapatch.__file__)\n")
        if shutil.which("nvidia-smi"):
            self.execute(["nvidia-smi"], 20, output)
        else:
            output.open("a").write("nvidia-smi: not found\n")
        ran = self.execute([self.python, "-c", probe], self.timeout_for("env"), output)
        facts = {}
        for line in output.read_text().splitlines():
            if line.startswith("LANE-ENV "):
                facts = json.loads(line[len("LANE-ENV "):])
        self.facts.update(facts)
        self.cuda = bool(facts.get("cuda")) and not self.args.dry_run
        ok = ran["rc"] == 0 and "imports ok" in output.read_text()
        self.record("env", "passed" if ok else "failed", seconds=ran["seconds"],
                    note=("CUDA: %s" % (facts.get("gpu") or "none")) + (" (dry run: not used)" if self.args.dry_run and facts.get("cuda") else ""))
        if not ok:
            raise SystemExit(1)

    def step_gpu_tests(self) -> None:
        if not self.cuda:
            return self.skip("gpu-tests", "no CUDA device (the `gpu`-marked tests need one)")
        self.pytest("gpu-tests", ["-m", "gpu", "tests", *self.ignored()], self.out / "tests.log", workers=8)

    def step_selftest(self) -> None:
        timeout = self.timeout_for("selftest")
        if timeout < 10:
            return self.skip("selftest", "no time left in the budget")
        output = self.out / "selftest.json"
        progress = self.scratch / "selftest.err"
        # smoke: one cheap scenario; the lane: every scenario
        selection = ["--scenario", "transformers-quantized-disk-weights/prequantized-checkpoint"] if self.args.smoke else ["--all"]
        command = [self.python, "-m", "metapatch.cli", "selftest", "--json", *selection, "--jobs", str(self.args.jobs)]
        started = time.monotonic()
        with open(output, "w") as sink, open(progress, "w") as errors:
            process = subprocess.Popen(command, cwd=str(ROOT), env=self.env, stdout=sink, stderr=errors,
                                       start_new_session=True)
            try:
                rc = process.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                rc, timed_out = process.wait(), True
        seconds = round(time.monotonic() - started, 1)
        with open(self.out / "lane.log", "a") as log:
            log.write(progress.read_text())
        try:
            rows = json.loads(output.read_text()).get("rows", [])
        except ValueError:
            rows = []
        if not rows:  # cut short: its JSON is written at the end, its progress lines say what finished
            rows = selftest_progress(progress.read_text())
            output.write_text(json.dumps({"rows": rows, "exit_code": None, "timed_out": timed_out,
                                          "note": "from the progress lines of a run that did not finish"}, indent=1))
        counts: Dict[str, int] = {}
        devices: Dict[str, int] = {}
        for row in rows:
            verdict = str(row.get("verdict", "?"))
            verdict = "n/a" if verdict.startswith("n/a") else verdict
            counts[verdict] = counts.get(verdict, 0) + 1
            device = row.get("device") or row.get("execution_device")
            if device:
                devices[str(device)] = devices.get(str(device), 0) + 1
        failures = [f"{row.get('scenario')}: {row.get('verdict')}" for row in rows if not row.get("ok", True)]
        if timed_out and not failures:
            status, note = "partial", f"{self.stopped_by('selftest', timeout)}, after {len(rows)} scenarios"
        else:
            status = "failed" if (rc != 0 or failures or not rows) else "passed"
            note = f"timed out after {len(rows)} scenarios" if timed_out else f"exit code {rc}"
        self.record("selftest", status, counts=counts, devices=devices, failures=failures[:40], seconds=seconds, note=note)

    def step_three_way(self) -> None:
        if not self.cuda:
            # The same files on the CPU are part of the suite step (and of CI); here only the cuda:0 leg counts.
            return self.skip("three-way", "no CUDA device (the cpu leg runs in the suite)")
        selection = [*THREE_WAY, "-m", "not gpu"]  # the gpu-marked ones ran in their own step
        if self.args.smoke:
            selection += ["-k", "auto-map-disk-layers"]
        # one xdist worker per file (loadfile), and within a file its scenario runs started ahead in threads
        self.pytest("three-way", selection, self.out / "tests.log", workers=len(THREE_WAY),
                    extra_env={"METAPATCH_TEST_WORKERS": "4"})

    def step_bench(self) -> None:
        timeout = self.timeout_for("bench")
        if timeout < 10:
            return self.skip("bench", "no time left in the budget")
        output = self.out / "bench.json"
        command = [self.python, str(ROOT / "benchmarks" / "bench_gpu_offload.py"), "--quick", "--json", str(output)]
        if not self.cuda:
            command += ["--device", "cpu"]
        if self.args.smoke:
            command += ["--smoke"]
        ran = self.execute(command, timeout, self.out / "lane.log", graceful=False)
        rows = json.loads(output.read_text())["rows"] if output.exists() else []
        if ran["timed_out"]:
            status, note = "partial", f"{self.stopped_by('bench', timeout)}, after {len(rows)} rows"
        else:
            status = "passed" if ran["rc"] == 0 and rows else ("partial" if rows else "failed")
            note = "timed out" if ran["timed_out"] else f"exit code {ran['rc']}"
        self.record("bench", status, seconds=ran["seconds"], rows=rows, note=note + ("" if self.cuda else " (cpu)"))

    def step_suite(self) -> None:
        ran_three_way = any(s["name"] == "three-way" and s["status"] != "skipped" for s in self.steps)
        arguments = ["tests", "-m", "not gpu", *self.ignored(), *(f"--ignore={p}" for p in THREE_WAY if ran_three_way)]
        if self.args.smoke:
            arguments = ["tests/test_selftest_requires.py"]
        self.pytest("suite", arguments, self.out / "suite.log", workers=self.args.workers)

    def ignored(self) -> List[str]:
        return [f"--ignore={path}" for path in SUITE_IGNORED]

    # -- summary ------------------------------------------------------------------------------------
    def summary(self) -> Dict[str, Any]:
        failed = [s["name"] for s in self.steps if s["status"] == "failed"]
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "mode": "gpu" if self.cuda else ("cpu dry run" + (" (smoke)" if self.args.smoke else "")),
            "gpu": self.facts.get("gpu", ""), "devices": self.facts.get("devices", 0),
            "commit": os.environ.get("GPU_LANE_COMMIT") or git_commit(),
            "stack": {k: self.facts.get(k) for k in ("python", "torch", "cuda_version", "transformers", "accelerate",
                                                     "peft", "bitsandbytes", "kernels", "huggingface_hub")},
            "budget_s": self.args.budget, "wall_s": round(time.monotonic() - self.started, 1),
            "steps": self.steps, "failed_steps": failed,
        }

    def write_summary(self) -> None:
        summary = self.summary()
        text = render_markdown(summary)
        (self.out / "summary.json").write_text(json.dumps({**summary, "markdown": text}, indent=2))
        (self.out / "summary.md").write_text(text + "\n")

    def run(self) -> int:
        self.say(f"GPU lane: budget {self.args.budget} s, out {self.out}" + (" (dry run)" if self.args.dry_run else "")
                 + (" (smoke)" if self.args.smoke else ""))
        try:
            for step in (self.step_install, self.step_env, self.step_gpu_tests, self.step_selftest,
                         self.step_three_way, self.step_bench, self.step_suite):
                name = step.__name__[len("step_"):].replace("_", "-")
                if name in self.args.skip:
                    self.skip(name, "left out of this run (--skip)")
                else:
                    step()
        except SystemExit:
            pass
        finally:
            self.write_summary()
            trim_logs(self.out)
        summary = self.summary()
        self.say(f"done in {summary['wall_s']} s: " + (f"FAILED steps: {summary['failed_steps']}" if summary["failed_steps"]
                                                       else "no step failed"))
        print(render_markdown(summary))
        shutil.rmtree(self.scratch, ignore_errors=True)
        return 1 if summary["failed_steps"] else 0


LOG_HEAD, LOG_TAIL = 20_000, 200_000  # characters kept of a long log (what comes back from a device run is limited)


def trim_logs(folder: Path) -> None:
    for log in folder.glob("*.log"):
        text = log.read_text(errors="replace")
        if len(text) > LOG_HEAD + LOG_TAIL:
            cut = len(text) - LOG_HEAD - LOG_TAIL
            log.write_text(text[:LOG_HEAD] + f"\n[... {cut} characters left out ...]\n" + text[-LOG_TAIL:])


PROGRESS = re.compile(r"^\[(\d+)/(\d+)\] (\S+): (.+?) \(\d+ s\)")


def selftest_progress(text: str) -> List[Dict[str, Any]]:
    """Rows (scenario, verdict, ok) from ``metapatch selftest``'s progress lines on stderr."""
    rows = []
    for line in text.splitlines():
        found = PROGRESS.match(line.strip())
        if found:
            verdict = found.group(4)
            rows.append({"scenario": found.group(3), "verdict": verdict,
                         "ok": verdict not in ("FAILED", "BUG OUTSIDE GATE")})
    return rows


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT), capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def render_markdown(summary: Dict[str, Any]) -> str:
    """The entry for docs/gpu-runs.md."""
    stack = summary["stack"]
    where = summary["gpu"] or "no GPU"
    lines = [f"### {summary['date']}: {where} ({summary['mode']})", "",
             f"- commit {summary['commit']}; Python {stack.get('python')}, torch {stack.get('torch')}"
             + (f" (CUDA {stack['cuda_version']})" if stack.get("cuda_version") else "")
             + f", transformers {stack.get('transformers')}, accelerate {stack.get('accelerate')}, peft {stack.get('peft')}, "
             f"bitsandbytes {stack.get('bitsandbytes')}",
             f"- wall time {summary['wall_s']} s of a {summary['budget_s']} s budget"
             + (f"; failed steps: {', '.join(summary['failed_steps'])}" if summary["failed_steps"] else "; no step failed"),
             "", "| step | result | counts | seconds | note |", "|---|---|---|---|---|"]
    for step in summary["steps"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted((step.get("counts") or {}).items()))
        if step.get("devices"):
            counts += " (devices: " + ", ".join(f"{k} {v}" for k, v in sorted(step["devices"].items())) + ")"
        lines.append(f"| {step['name']} | {step['status']} | {counts} | {step.get('seconds', '')} | {step.get('note', '')} |")
    notes = []
    for step in summary["steps"]:
        for row in step.get("rows") or ():
            notes.append(f"- bench, {row['name']}: upstream {row['upstream']:.2f} ms, metapatch {row['metapatch']:.2f} ms, "
                         f"ratio {row['ratio']:.3f} (spread {row['spread'][0]:.3f}-{row['spread'][1]:.3f}, {row['rounds']} rounds)"
                         + (f"; upstream fails: {row['upstream_error']}" if row.get("upstream_error") else ""))
        if step.get("failures"):
            notes.append(f"- {step['name']} failures: " + "; ".join(step["failures"][:10]))
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download the wheels (needs network)")
    prep.add_argument("--dest", default=str(WHEELS))
    prep.add_argument("--python-version", default="3.12", help="the GPU image's Python")
    go = commands.add_parser("run", help="install from the wheels and run the lane")
    go.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / ".gpu" / "out"))
    go.add_argument("--wheels", default=str(WHEELS))
    go.add_argument("--site", help="where to extract the wheels (default: a temporary folder)")
    go.add_argument("--python", help="the interpreter for the steps (default: this one)")
    go.add_argument("--budget", type=float, default=330.0, help="seconds for the whole lane, extraction included")
    go.add_argument("--workers", type=int, default=15, help="xdist workers of the suite step")
    go.add_argument("--jobs", type=int, default=8, help="parallel selftest runs")
    go.add_argument("--dry-run", action="store_true", help="no GPU steps even where CUDA is present")
    go.add_argument("--smoke", action="store_true", help="every step at its smallest selection (CI)")
    go.add_argument("--skip", default="", type=lambda text: {name.strip() for name in text.split(",") if name.strip()},
                    help="steps to leave out of this run, comma-separated (e.g. bench,suite): reported skipped")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return prepare(Path(args.dest), args.python_version)
    return Lane(args).run()


if __name__ == "__main__":
    sys.exit(main())
