"""The versions metapatch is tested with: the CI matrix, as plain data.

``metapatch pins`` reads it, and the matrix runner (nox) should too, so that what is pinned for
users and what is tested cannot drift apart. transformers and accelerate are tested as pairs;
the other distributions are the same in every row.
"""

COMMON = {
    "torch": "2.13.0",
    "peft": "0.21.2",
    "bitsandbytes": "0.50.2",
}

# (transformers, accelerate): the seeds' versions, a Gemma 4 integer-key release, the latest.
PAIRS = (
    ("5.11.0", "1.13.0"),
    ("5.7.0", "1.13.0"),
    ("5.24.0", "1.15.0"),
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
}
PYTHON_WINDOW = ">=3.9,<3.14"  # the framework and CLI; the heavy stack where its wheels exist
