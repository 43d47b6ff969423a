"""``metapatch enable`` / ``metapatch disable``: activate metapatch for every Python process of a
virtual environment, without editing scripts, by writing (and removing) one ``.pth`` file in the
environment's site-packages.

``site`` executes ``import`` lines of ``.pth`` files at every interpreter start. The line written
here imports metapatch inside ``try``/``except`` and imports nothing else, so an interpreter still
starts when metapatch is broken (one line on stderr says so) or uninstalled (silently). A ``.pth``
file rather than a ``sitecustomize``: an environment has at most one ``sitecustomize`` module, which
may already be someone else's, while ``.pth`` files add up, and removing ours undoes exactly what
``enable`` did. ``METAPATCH_AUTOLOAD=0`` turns it off for one process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HELP = "activate metapatch in every Python process of this virtual environment (writes one .pth file)"
DISABLE_HELP = "undo `metapatch enable`: remove metapatch's .pth file from this environment"

# Files in a site directory are processed in name order: "__editable__.*.pth" (how pip installs
# metapatch with -e) sorts before this name, so metapatch is importable when our line runs.
PTH_NAME = "metapatch-enable.pth"

_IMPORT_CODE = """try:
    import metapatch
except Exception as exc:
    if not (isinstance(exc, ImportError) and exc.name == "metapatch"):
        sys.stderr.write("metapatch: not active (%s: %s); `metapatch disable` or delete %s to stop trying\\n"
                         % (type(exc).__name__, exc, {path!r}))
"""


def pth_line(path: Path) -> str:
    """The one line of the .pth file: guarded, and skipped under METAPATCH_AUTOLOAD=0."""
    code = _IMPORT_CODE.format(path=str(path))
    return f"import os, sys; exec({code!r}) if os.environ.get('METAPATCH_AUTOLOAD', '1') != '0' else None\n"


def site_packages() -> Path:
    """This interpreter's purelib folder (site-packages of the active environment)."""
    return Path(sysconfig.get_paths()["purelib"])


def in_virtual_env() -> bool:
    return sys.prefix != getattr(sys, "base_prefix", sys.prefix)


def importable_without_cwd() -> bool:
    """Whether this interpreter finds metapatch from any directory (installed, not just the source
    checkout in the current directory), with our own start-up hooks off."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "METAPATCH_BOOTSTRAP_HOME")}
    env["METAPATCH_AUTOLOAD"] = "0"
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('metapatch') else 3)"
    with tempfile.TemporaryDirectory() as neutral:
        return subprocess.run([sys.executable, "-c", probe], cwd=neutral, env=env).returncode == 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would be written, change nothing")
    parser.add_argument("--force", action="store_true",
                        help="also outside a virtual environment (the system or conda base interpreter)")


def add_disable_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would be removed, change nothing")


def run(args: argparse.Namespace) -> int:
    target = site_packages() / PTH_NAME
    if not in_virtual_env() and not args.force:
        print(f"metapatch enable: {sys.prefix} is not a virtual environment; enabling would affect every program "
              f"of this interpreter. Use a venv, `metapatch run PROGRAM` for one program, or --force.", file=sys.stderr)
        return 2
    line = pth_line(target)
    if args.dry_run:
        print(f"would write {target}:\n{line}", end="")
        return 0
    if not importable_without_cwd():
        print(f"metapatch enable: warning: {sys.executable} finds metapatch only from the current directory; "
              f"install it (pip install metapatch) or the .pth file has no effect elsewhere", file=sys.stderr)
    existed = target.exists()
    target.write_text(line)
    print(f"{'rewrote' if existed else 'wrote'} {target}: every new Python process of {sys.prefix} imports metapatch "
          f"(`metapatch disable` removes it; METAPATCH_AUTOLOAD=0 skips it for one process)")
    return 0


def run_disable(args: argparse.Namespace) -> int:
    target = site_packages() / PTH_NAME
    if not target.exists():
        print(f"not enabled: {target} does not exist")
        return 0
    if args.dry_run:
        print(f"would remove {target}")
        return 0
    target.unlink()
    print(f"removed {target}")
    return 0
