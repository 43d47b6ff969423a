"""The versions metapatch is tested with: the CI matrix, as plain data.

``metapatch pins`` reads it, and the matrix runner (nox) should too, so that what is pinned for
users and what is tested cannot drift apart. transformers and accelerate are tested as pairs;
the other distributions are the same in every row.
"""

COMMON = {
    "torch": "2.13.0",
    "peft": "0.22.0",  # transformers 5.24+ asks for peft >= 0.22 for adapter switching (MIN_PEFT_VERSION)
    "bitsandbytes": "0.50.2",
}

# (transformers, accelerate): the seeds' versions, a Gemma 4 integer-key release, the latest.
PAIRS = (
    ("5.11.0", "1.13.0"),
    ("5.7.0", "1.13.0"),
    ("5.25.0", "1.16.0"),
)

MATRIX = tuple(
    {**COMMON, "transformers": transformers, "accelerate": accelerate}
    for transformers, accelerate in PAIRS
)

# The declared support window: metapatch's patches are measured (``metapatch survey``) on every
# release inside it. A patch whose gate sees a version outside the window reports ``not-measured``
# (nothing is patched, and the reason says to run ``metapatch selftest``) instead of guessing.
SUPPORT_WINDOW = {
    "transformers": ">=4.57.0,<6",
    "accelerate": ">=1.10.0,<2",
    "peft": ">=0.17.0,<1",
    "bitsandbytes": ">=0.46.0,<1",
    "gguf": ">=0.10.0,<1",  # llama.cpp's gguf-py, for the converter patch (`metapatch run`)
}
# Distributions whose releases the survey reads but never installs: each release's wheel is read where it
# lies (HTTP range requests, only the targets' modules) for the fingerprints of the objects patched there,
# and no reproducer runs on it (a torch wheel is gigabytes, a CUDA build per release). Behaviour is measured
# on the torch the suite pins (COMMON["torch"]) and by `metapatch selftest` on the user's own. Not a gate:
# where a release's code differs, the target's fingerprints make the patch stale there. torch 2.4 has no
# ``Module.mtia`` (offloaded-move-guard patches it), so the window starts at 2.5.
READ_ONLY_WINDOW = {"torch": ">=2.5,<3"}
PYTHON_WINDOW = ">=3.9,<3.14"  # the framework and CLI; the heavy stack where its wheels exist

# Stacks between and before the matrix pairs that CI checks with a short gate (strict
# `metapatch status --import-targets` and `metapatch selftest --json`), so that the window is
# exercised beyond the three full-suite pairs: the oldest supported releases, an early 5.x, a
# middle 5.x and the previous latest pair (the releases before the newest). torch is COMMON["torch"]
# everywhere but where a stack names its own.
GATE_STACKS = {
    "oldest": {"transformers": "4.57.1", "accelerate": "1.10.0", "peft": "0.17.0", "bitsandbytes": "0.46.1"},
    "early5": {"transformers": "5.2.0", "accelerate": "1.11.0", "peft": "0.18.0", "bitsandbytes": "0.47.0"},
    "mid": {"transformers": "5.17.0", "accelerate": "1.14.0", "peft": "0.19.1", "bitsandbytes": "0.49.2"},
    # The pair before the latest one: users upgrade one package at a time, and accelerate 1.15 still has a bug
    # that 1.16 does not (FSDP2's cpu_ram_efficient_loading of plain buffers); with the peft before the latest
    # (0.21: another code variant of five of peft-offload-redispatch's targets).
    "previous": {"transformers": "5.24.0", "accelerate": "1.15.0", "peft": "0.21.2", "bitsandbytes": "0.50.2"},
    # The latest pair on another torch: the project's GPU machine runs torch 2.11, which FSDP2 tells apart
    # (no duplicate-parameter check before 2.13: a doubly grouped tie trained wrong there, silently, while
    # 2.13 raises). Other torch releases are only read (READ_ONLY_WINDOW). PyPI's build, a CUDA one, on the CPU.
    "torch211": {"transformers": "5.25.0", "accelerate": "1.16.0", "peft": "0.22.0", "bitsandbytes": "0.50.2",
                 "torch": "2.11.0"},
}

# Python versions the framework and CLI are tested on without the heavy stack.
FRAMEWORK_PYTHONS = ("3.9", "3.13")
