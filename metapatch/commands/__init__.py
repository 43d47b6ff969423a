"""Sub-commands of the ``metapatch`` CLI, one module each (see metapatch.cli)."""

from __future__ import annotations

import logging


class UsageError(Exception):
    """Bad usage or input (a missing file, an unknown id, malformed JSON): ``metapatch.cli.main``
    prints the message as one line on stderr and exits 2."""


# bitsandbytes (0.50 on CPUs with AVX512-BF16) asks the `kernels` package for a Hub kernel while it is imported,
# and logs this warning whenever that fails (no network, an untrusted publisher, `kernels` missing); it then
# uses its own CPU code. metapatch's commands import bitsandbytes for their own work (doctor, selftest), where
# the line says nothing about the user's model, so they drop it; user programs keep upstream's behaviour
# (the README says how to silence it there).
_UPSTREAM_IMPORT_NOISE = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_upstream_import_noise() -> None:
    """In this process only: drop the import-time warnings in ``_UPSTREAM_IMPORT_NOISE`` (idempotent)."""
    for logger_name, prefix in _UPSTREAM_IMPORT_NOISE.items():
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))
