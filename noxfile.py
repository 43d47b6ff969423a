"""The version matrix. Every session runs the whole suite in strict mode (a stale or failed patch
is an error), after checking that `metapatch status` reports no stale or failed patch once every
target is imported.

    python3 -m nox                      # the whole matrix (what CI runs)
    python3 -m nox -s "tests(env='latest')"   # one environment
"""

import nox

nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = True

# torch is pinned everywhere: an open range pulls a multi-GB CUDA build.
COMMON = ["torch==2.13.0", "peft==0.21.2", "bitsandbytes==0.50.2"]
MATRIX = {
    # the seed reports' versions
    "seed": {"transformers": "5.11.0", "accelerate": "1.13.0"},
    # a Gemma 4 release with integer shared-KV keys
    "gemma4-int": {"transformers": "5.7.0", "accelerate": "1.13.0"},
    # the latest releases
    "latest": {"transformers": "5.24.0", "accelerate": "1.15.0"},
}


@nox.session(python="3.11")
@nox.parametrize("env", list(MATRIX))
def tests(session, env):
    versions = MATRIX[env]
    session.install("torch==2.13.0")  # first, alone, so nothing else can pick a CUDA build
    session.install(*COMMON, *(f"{dist}=={ver}" for dist, ver in versions.items()), "safetensors",
                    "pytest>=8", "hypothesis>=6", "parameterized")
    session.install("-e", ".")  # with its own dependencies (wrapt, packaging); the stack is pinned above
    session.env["METAPATCH_STRICT"] = "1"
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("metapatch", "status", "--import-targets")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.posargs)
