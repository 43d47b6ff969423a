"""Bad input to any command: one line on stderr naming it, the documented exit code, never a traceback; a closed
output pipe is no traceback either. Run as users run the CLI (a subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, code: str = "", **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH")}
    command = ([sys.executable, "-c", code + "\nfrom metapatch.cli import main; sys.exit(main(sys.argv[1:]))", *args]
               if code else [sys.executable, "-m", "metapatch", *args])
    streams = {"stderr": subprocess.PIPE} if "stdout" in kwargs else {"capture_output": True}
    return subprocess.run(command, cwd=REPO, env=env, text=True, timeout=300, **streams, **kwargs)


def _one_line(done: subprocess.CompletedProcess, command: str, message: str) -> None:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"metapatch {command}: ") and message in lines[0], done.stderr


@pytest.mark.parametrize("args, message", [
    (("fingerprint", "json"), "is not MODULE:QUALNAME"),
    (("fingerprint", "no_such_module_here:f"), "cannot import no_such_module_here"),
    (("fingerprint", "json:no_such_attribute"), "json has no no_such_attribute"),
    (("status", "offloaded-move-gard"), "did you mean"),
    (("explain", "nope.txt"), "nope.txt: no such file"),
    (("explain", "docs"), "docs is a folder"),
    (("sweep", "--output", "no-such-folder/table.md"), "no-such-folder does not exist"),
    (("sweep", "--jobs", "0"), "--jobs and --limit must be at least 1"),
    (("diffs",), "name the action"),
    (("diffs", "check", "no-such-patch"), "unknown patch id(s) no-such-patch"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    done = _cli(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    _one_line(done, args[0], message)


def test_sweep_without_transformers_is_one_line():
    done = _cli("sweep", "--sample", code="import sys; sys.modules['transformers'] = None")
    assert done.returncode == 2
    _one_line(done, "sweep", "install torch and transformers")


def test_fingerprint_prints_a_real_fingerprint():
    done = _cli("fingerprint", "json:dumps")
    assert done.returncode == 0 and re.fullmatch(r"json:dumps [0-9a-f]{16}\n", done.stdout), done.stdout


@pytest.mark.parametrize("args", [("pins",), ("status",), ("explain", "tests/explain/tracebacks/to_float16.txt")])
def test_a_closed_output_pipe_is_no_traceback(args):
    reader, writer = os.pipe()
    os.close(reader)  # `metapatch pins | head -1`: the reader has gone before the rest is written
    try:
        done = _cli(*args, stdout=writer)
    finally:
        os.close(writer)
    assert done.returncode == 141 and "Error" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_help_lists_every_environment_variable_the_readme_lists():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(METAPATCH_[A-Z_]+)", section))
    assert len(documented) >= 6
    done = _cli("--help")
    listed = set(re.findall(r"METAPATCH_[A-Z_]+", done.stdout))
    assert documented <= listed, documented - listed
    for code in ("0", "1", "2", "3", "141"):
        assert re.search(rf"^\s+{code}\s+\S", done.stdout, re.M), f"exit code {code} is not documented"


def test_commands_drop_only_bitsandbytes_kernel_line(caplog):
    """bitsandbytes logs this at import on AVX512-BF16 CPUs where `kernels` cannot fetch its Hub kernel; the
    CLI drops that one message in its own process, nothing else from that logger."""
    import logging

    from metapatch.commands import _DropMessage, quiet_upstream_import_noise

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    before = list(logger.filters)
    # Another test in this worker may have run a command in-process already: start from no filter of ours.
    others = [f for f in before if not isinstance(f, _DropMessage)]
    logger.filters[:] = others
    try:
        quiet_upstream_import_noise()
        quiet_upstream_import_noise()  # idempotent
        assert len(logger.filters) == len(others) + 1
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "trust")
            logger.warning("another warning")
        assert [r.getMessage() for r in caplog.records] == ["another warning"]
    finally:
        logger.filters[:] = before
