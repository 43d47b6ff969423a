"""The version matrix. Every session runs the whole suite in strict mode (a stale or failed patch
is an error), after checking that `metapatch status` reports no stale or failed patch once every
target is imported.

    python3 -m nox                      # the whole matrix (what CI runs)
    python3 -m nox -s "tests(env='latest')"   # one environment
"""

import runpy

import nox

nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = True

# The matrix is metapatch's own data (metapatch pins reads it too), loaded without importing the
# package: nox runs in an interpreter that has none of metapatch's dependencies.
TESTED = runpy.run_path("metapatch/tested_versions.py")
NAMES = {("5.11.0", "1.13.0"): "seed", ("5.7.0", "1.13.0"): "gemma4-int", ("5.24.0", "1.15.0"): "latest"}
MATRIX = {NAMES.get(pair, "t{}-a{}".format(*pair)): {"transformers": pair[0], "accelerate": pair[1]}
          for pair in TESTED["PAIRS"]}
# torch is pinned everywhere: an open range pulls a multi-GB CUDA build.
COMMON = [f"{dist}=={version}" for dist, version in TESTED["COMMON"].items()]


@nox.session(python="3.11")
@nox.parametrize("env", list(MATRIX))
def tests(session, env):
    versions = MATRIX[env]
    session.install(f"torch=={TESTED['COMMON']['torch']}")  # first, alone, so nothing else can pick a CUDA build
    session.install(*COMMON, *(f"{dist}=={ver}" for dist, ver in versions.items()), "safetensors",
                    "pytest>=8", "pytest-xdist", "hypothesis>=6", "parameterized")
    session.install("-e", ".")  # with its own dependencies (wrapt, packaging); the stack is pinned above
    session.env["METAPATCH_STRICT"] = "1"
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("metapatch", "status", "--import-targets")
    # Two workers for two cores; a file's tests stay on one worker, so a test that watches the
    # working directory never sees another test's files.
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                *session.posargs)
