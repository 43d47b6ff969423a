"""The version matrix. CI (`.ci/run`) runs every session:

* ``tests(env=...)``: the suite in strict mode (a stale or failed patch is an error) on each matrix pair,
  after checking that `metapatch status` reports no stale or failed patch once every target is imported; the
  tests that do not depend on the pair, and the upstream-diff legs, on the latest pair only (``ONCE``);
* ``gate(stack=...)``: strict ``metapatch status --import-targets`` and ``metapatch selftest --json --all``
  on stacks between and before the matrix pairs, and the latest pair on torch 2.11.0 (``GATE_STACKS``),
  so that the declared support window is exercised beyond the three pairs; on the mid stack also the in-process
  4-bit write tests and the flow tester, on the torch 2.11.0 stack the write tests (``GATE_TESTS``);
* ``framework(python=...)``: the registry and CLI tests on the oldest and newest supported Python,
  without the heavy stack.
* ``lint``: the import-linter contracts of pyproject.toml (the layers: tools -> patches -> offload
  mechanisms -> framework, no import circles, no torch in the framework), in a second, without the stack.
* ``package``: the sdist and the wheel built, checked and installed outside the clone.

Not in the default run: ``fast`` (a few minutes: the default selftest and the quick tests on the latest pair)
and ``gpu_lane``.

    python3 -m nox                             # everything (what CI runs)
    python3 -m nox -s fast                     # the quick check
    python3 -m nox -s "tests(env='latest')"    # one environment
"""

import glob
import os
import runpy
import shutil

import nox

nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = True

# The matrix is metapatch's own data (metapatch pins reads it too), loaded without importing the
# package: nox runs in an interpreter that has none of metapatch's dependencies.
TESTED = runpy.run_path("metapatch/tested_versions.py")
NAMES = {("5.11.0", "1.13.0"): "seed", ("5.7.0", "1.13.0"): "gemma4-int", ("5.25.0", "1.16.0"): "latest"}
MATRIX = {NAMES.get(pair, "t{}-a{}".format(*pair)): {"transformers": pair[0], "accelerate": pair[1]}
          for pair in TESTED["PAIRS"]}
TORCH = f"torch=={TESTED['COMMON']['torch']}"  # pinned everywhere: an open range pulls a multi-GB CUDA build
COMMON = [f"{dist}=={version}" for dist, version in TESTED["COMMON"].items() if dist != "torch"]
# ruff: tests/test_pr_checks.py runs `metapatch pr`'s lint step for real (pinned, like every tool here).
TEST_TOOLS = ["safetensors", "pytest>=8", "pytest-xdist", "hypothesis>=6", "parameterized", "gguf==0.19.0",
              "ruff==0.13.1"]
# Run in one environment only (latest), to keep CI under its 60 minutes on 2 cores: tests of
# metapatch's own tooling that do not depend on the stack, and the per-PR reproducers of the peft
# diff series (every environment pins the same peft).
#
# Also once: the sweep's sample and the flow tester (measurement tools whose patches the other files prove
# per pair), the two-rank FSDP tests (two interpreters per rank; the `mid` gate's selftest runs their
# scenarios on transformers 5.17 / accelerate 1.14) and the 4-bit CPU-repack tests (bitsandbytes is the same
# release in every pair; the gates run its scenarios on 0.49.2). Elsewhere the tests marked `slow` (upstream
# diff legs, long variants) are left to the latest pair as well.
#
# And the standalone upstream reproducers (tests/test_reproducers.py: each `upstream_diffs/<id>/reproducer.py`
# run as the upstream PR would, 2-3 min a pair): they are written for the PR against upstream's newest
# release; in every pair the three-way tests run the same scenarios unpatched, patched and with the diff.
#
# And the command-line tooling whose tests use one patch's scenarios and do not depend on the pair
# (selftest/doctor, `metapatch run`, explain, pr pins, the registry, which the framework sessions also
# run), the upstream suites (accelerate's and peft's own tests with metapatch active: one hunt for silent
# wrongs, on the newest releases), and the PEFT tuner matrix (six scenarios x unpatched/patched/diff, 4-5
# min of one worker on the older pairs; test_peft_offload_redispatch.py keeps the PEFT patch's three-way
# proof in every pair, and the gates run the tuner scenarios unpatched and patched on the five gate stacks).
# Measured on the seed pair (junit): these were about 730 of its 3000 worker-seconds;
# CI had reached 3656 s of its 60 minutes.
ONCE = ["tests/test_pr_checks.py", "tests/test_series_reproducers.py", "tests/test_reproducers.py",
        "tests/test_diffs_run_real.py",
        "tests/test_sweep.py", "tests/test_flows.py", "tests/test_forked_ranks.py",
        "tests/test_selftest_device.py",
        # the two-rank FSDP patches, one file each, and the rank runner they share
        "tests/patches/test_fsdp_rank_placeholders.py", "tests/patches/test_accelerate_fsdp2_plain_buffers.py",
        "tests/patches/test_accelerate_fsdp2_adapter_state.py", "tests/patches/test_accelerate_fsdp2_shared_embeddings.py",
        "tests/patches/test_peft_tp_shard_import.py", "tests/mechanisms/test_rank_runner.py",
        "tests/patches/test_bnb_cpu_repack_copy.py",
        "tests/test_cli_selftest_doctor.py", "tests/test_run.py", "tests/test_run_report.py", "tests/test_explain.py",
        "tests/test_cli_pr_pins.py", "tests/test_cli_errors.py",
        "tests/test_registry.py", "tests/test_upstream_suites.py", "tests/patches/test_peft_offload_redispatch_tuners.py",
        "tests/test_gpu_lane.py"]
# The upstream-diff leg of the three-way tests (``test_upstream_diff_alone``) runs on the latest pair only: each diff
# is written against upstream's newest release, for upstream's main branch, and on an older pair it applies only by
# chance. The unpatched and patched legs run on every pair (and the gates run both on five more stacks). Measured
# on the older pairs (junit, one CI run on 2 cores): the diff legs were 287 and 284 of their 1149 and 996
# worker-seconds, about 5 minutes of CI between them.
#
# The public-report corpus (about 3.5 min per environment) runs on the seed and latest pairs; the
# Gemma 4 integration pair (5.7) adds nothing to it that those two do not cover.
NOT_IN = {"gemma4-int": ["tests/reports"]}
# The Gemma 4 integer-key pair runs the per-patch tests only (tests/patches: each patch's unpatched and patched
# legs and its in-process checks); the framework, CLI and tooling tests it would add (about 120 worker-seconds)
# run on the seed and latest pairs.
ONLY_IN = {"gemma4-int": ["tests/patches"]}


def _interpreter(version: str) -> str:
    """A path to python<version>: on PATH, or a pyenv install (pyenv shims refuse versions that are
    not selected, so look at the installs themselves)."""
    found = shutil.which(f"python{version}")
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for candidate in sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}"))):
        return candidate
    return found or f"python{version}"


# torch and what it needs, installed once (``pip install --target``) for every session that needs the heavy
# stack and put on each session's path by a .pth file: the same pinned build in every session, and one
# install instead of six (measured on a 2-core machine: 93 s for the shared install, then 8 s a session
# to confirm it, against about 90-130 s for each session's own). The framework sessions never see it.
SHARED_TORCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".nox", "_shared-torch")


def _share_torch(session):
    done = os.path.join(SHARED_TORCH, f".{TORCH}.done")
    if not os.path.exists(done):  # nox runs sessions one at a time: no other session writes it meanwhile
        shutil.rmtree(SHARED_TORCH, ignore_errors=True)
        # run_install: also under ``nox --install-only`` (which skips session.run), so that mode builds a usable venv
        session.run_install("python", "-m", "pip", "install", "-q", "--target", SHARED_TORCH, TORCH)
        open(done, "w").close()
    site = session.run_install("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                               silent=True).strip()
    with open(os.path.join(site, "metapatch-shared-torch.pth"), "w") as pth:
        pth.write(SHARED_TORCH + "\n")  # after the venv's own site-packages: what a session installs wins


def _install_stack(session, versions, editable=True):
    # Byte-compiled at install (pip's default), never --no-compile: with PYTHONDONTWRITEBYTECODE set, as
    # on CI's machines, nothing is compiled later, and every interpreter a test starts would compile
    # the stack from source (measured: the seed pair's tests ran far slower with --no-compile).
    if "torch" in versions:  # a gate stack on another torch: its own, in the session's venv
        session.install(f"torch=={versions['torch']}")
    else:
        _share_torch(session)
        session.install(TORCH)  # first, alone, so nothing else can pick a CUDA build (satisfied by the shared one)
    pins = {**{d: v for d, v in TESTED["COMMON"].items() if d != "torch"},
            **{d: v for d, v in versions.items() if d != "torch"}}
    session.install(*(f"{dist}=={ver}" for dist, ver in pins.items()), *TEST_TOOLS)
    if editable:
        session.install("-e", ".")  # with its own dependencies (wrapt, packaging); the stack is pinned above
    session.env["METAPATCH_STRICT"] = "1"
    # Every patched library is installed here: a test module whose patch's library is missing fails the run instead
    # of being skipped (tests/conftest.py), so a broken install never passes as a shorter run.
    session.env["METAPATCH_TESTS_EVERY_LIBRARY"] = "1"
    # One intra-op thread per process: two workers (or lanes) on two cores, each starting interpreters that
    # run tiny models, where torch's thread per core spins while it waits (measured: 30-40 % less wall time
    # for a patch's scenarios at two jobs). Every comparison is made within one process, so the numbers the
    # tests compare are computed the same way on both sides.
    session.env["OMP_NUM_THREADS"] = "1"
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)


@nox.session(python="3.11")
@nox.parametrize("env", list(MATRIX))
def tests(session, env):
    _install_stack(session, MATRIX[env])
    session.run("metapatch", "status", "--import-targets")
    # Two workers for two cores; a file's tests stay on one worker, so a test that watches the
    # working directory never sees another test's files.
    skipped = ([] if env == "latest" else ONCE) + NOT_IN.get(env, [])
    marks = [] if env == "latest" else ["-m", "not slow", "-k", "not test_upstream_diff_alone"]
    # Per-test times, for whoever trims CI next; beside the venv, never through session.create_tmp(), which
    # points TMPDIR into this repository (tests that need a directory outside any git clone then fail).
    junit = os.path.join(session.virtualenv.location, "junit.xml")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", "--durations=40",
                f"--junitxml={junit}",
                *marks, *[arg for path in skipped for arg in ("--ignore", path)], *session.posargs,
                *(ONLY_IN.get(env, []) if not session.posargs else []))


# A quick check before the full run (the README's fast command): on the latest pair, the default selftest
# (every patch's bug reproduced and fixed once, on real paths) and the tests that need no model loads of their
# own beyond a few tiny ones: the registry and lifecycle, the CLI, diagnosis, the upstream-diff checks, the
# survey tables, the selftest layout and the docs. Not a default session: CI runs all of these anyway.
FAST = ["tests/test_registry.py", "tests/test_lifecycle.py", "tests/test_unpatch_install.py",
        "tests/test_concurrent_import.py", "tests/test_enable.py", "tests/test_hook_state.py",
        "tests/test_cli_errors.py", "tests/test_explain.py", "tests/test_diagnose.py", "tests/test_diffs.py",
        "tests/test_survey.py", "tests/test_selftest_layout.py", "tests/test_selftest_requires.py",
        "tests/test_tied_groups_sizes.py", "tests/reports/test_docs.py"]


@nox.session(python="3.11", default=False)
def fast(session):
    _install_stack(session, MATRIX["latest"])
    session.run("metapatch", "status", "--import-targets")
    session.run("metapatch", "selftest")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                "-m", "not slow and not ranks", *FAST, *session.posargs)


# The selftest runs one scenario at a time; two lanes (each its own `metapatch selftest`) keep both
# CI cores busy. The PEFT patch goes first in lane 0 and the other patches alternate between the lanes
# by id: with the PEFT patch alone in a lane, the mid stack's lanes took 112 s and about 600 s (the
# two-rank scenarios of the distributed patches are in the other one).
GATE_FIRST = ("peft-offload-redispatch",)
# In-process tests a gate stack runs too, after its selftest: the 4-bit write tests and the flow tester (plain and
# 4-bit). Every pair has bitsandbytes 0.50.2; the mid stack has 0.49.2 with transformers 5.17 and accelerate 1.14,
# where a deep copy of a 4-bit model with disk layers raised TypeError while every pair passed (found by hand).
GATE_TESTS = {"mid": ["tests/patches/test_offloaded_placeholder_writes_4bit.py",
                      "tests/patches/test_bnb_cpu_repack_copy_writes.py", "tests/test_flows.py"],
              # The write path into offloaded weights leans on torch's own code (dispatch, torch.nn.init): on the GPU
              # machine's torch, whose orthogonal_ draws into weight.new_empty() where 2.13 returns at once on meta.
              "torch211": ["tests/patches/test_offloaded_placeholder_writes.py",
                           "tests/patches/test_offloaded_placeholder_writes_forward.py"]}


@nox.session(python="3.11")
@nox.parametrize("stack", list(TESTED["GATE_STACKS"]))
def gate(session, stack):
    import json
    import subprocess

    _install_stack(session, TESTED["GATE_STACKS"][stack])
    session.run("metapatch", "status", "--import-targets")
    index = runpy.run_path("metapatch/patches/__init__.py")["INDEX"]
    others = sorted(set(index) - set(GATE_FIRST))
    lanes = [[*GATE_FIRST, *others[1::2]], others[0::2]]
    tmp = session.create_tmp()
    env = {key: value for key, value in {**os.environ, **session.env}.items() if value is not None}  # None = unset
    env["PATH"] = session.bin + os.pathsep + os.environ.get("PATH", "")
    if "torch" in TESTED["GATE_STACKS"][stack]:
        # PyPI's torch is a CUDA build: where it may meet a GPU the selftest's warm parents leave bitsandbytes (which
        # initialises CUDA at import) to every child (measured on 2 cores: the torch211 gate 4 min against 2 for the
        # others). CI has no GPU; hidden, the parents preload it as on the CPU build.
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    runs = []
    for number, lane in enumerate(lanes):
        report = open(os.path.join(tmp, f"selftest-{stack}-{number}.json"), "w")
        # Every scenario (the default is one per patch), one at a time per lane: the lanes fill the cores.
        command = [os.path.join(session.bin, "metapatch"), "selftest", "--json", "--all", "--jobs", "1"]
        for pid in lane:
            command += ["--patch", pid]
        runs.append((subprocess.Popen(command, stdout=report, env=env), report))
    failed = []
    for process, report in runs:
        code = process.wait()
        report.close()
        with open(report.name) as handle:
            text = handle.read()
        session.log(text)
        try:
            rows = json.loads(text)["rows"]
        except (ValueError, KeyError):
            rows = []
        failed += [row["scenario"] for row in rows if not row.get("ok")]
        if code != 0 and not failed:
            failed.append(f"metapatch selftest exited {code} ({report.name})")
    if failed:
        session.error(f"selftest on {stack}: not fixed: {failed}")
    if stack in GATE_TESTS:
        session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                    *GATE_TESTS[stack])


# The GPU lane (.ci/gpu_lane.py): not a default session. On a machine with CUDA it installs the matrix pair
# from the wheels `python3 .ci/gpu_lane.py prepare` put in .gpu/whl and runs the lane in one go (about 5.5 min);
# elsewhere it runs the CPU dry run. CI runs the dry run at its smallest through tests/test_gpu_lane.py.
#     python3 -m nox -s gpu_lane -- --out DIR [--budget 330] [--dry-run]
@nox.session(python=False, default=False)
def gpu_lane(session):
    session.run("python3", ".ci/gpu_lane.py", "run", *session.posargs, external=True)


@nox.session(python=[_interpreter(v) for v in TESTED["FRAMEWORK_PYTHONS"]])
def framework(session):
    session.install("-e", ".", "pytest>=8", "hypothesis>=6")
    session.env["METAPATCH_STRICT"] = "1"
    session.run("metapatch", "--help")
    session.run("metapatch", "status")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_registry.py", *session.posargs)


# Pinned like every tool here. Reads the sources only (lint-imports puts the working directory on the path):
# nothing is installed but the linter.
IMPORT_LINTER = "import-linter==2.17"


@nox.session(python="3.11")
def lint(session):
    session.install(IMPORT_LINTER)
    session.run("lint-imports", "--no-cache")


# The distributions users install: the sdist and the wheel are built and checked (twine), the sdist is installed
# (so it holds everything a build needs), then the wheel, not editable, beside the latest pair; from a folder
# outside the clone (nothing importable from the source tree) `metapatch status --import-targets` and the
# default `metapatch selftest` must pass, as the README's set-up promises.
BUILD_TOOLS = ["build==1.3.0", "twine==6.2.0"]


@nox.session(python="3.11")
def package(session):
    import tempfile

    session.install(*BUILD_TOOLS)
    dist = tempfile.mkdtemp(prefix="metapatch-dist-")  # never session.create_tmp(): that is inside the clone
    session.run("python", "-m", "build", "--outdir", dist, ".")
    sdist = glob.glob(os.path.join(dist, "metapatch-*.tar.gz"))
    wheel = glob.glob(os.path.join(dist, "metapatch-*.whl"))
    if len(sdist) != 1 or len(wheel) != 1:
        session.error(f"expected one sdist and one wheel in {dist}: {os.listdir(dist)}")
    session.run("twine", "check", "--strict", sdist[0], wheel[0])
    _install_stack(session, MATRIX["latest"], editable=False)
    outside = tempfile.mkdtemp(prefix="metapatch-installed-")
    session.install(sdist[0])
    with session.chdir(outside):
        session.run("metapatch", "--version")
        session.run("metapatch", "status", "--import-targets")
    session.install("--force-reinstall", "--no-deps", wheel[0])
    with session.chdir(outside):
        session.run("python", "-c", "import metapatch, os, sys; path = os.path.dirname(metapatch.__file__); "
                    "sys.exit(0 if 'site-packages' in path else 'metapatch imported from ' + path)")
        session.run("metapatch", "diffs", "check", "--import-targets")
        session.run("metapatch", "selftest")
