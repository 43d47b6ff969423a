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
