"""``metapatch enable`` / ``disable`` in a throw-away virtual environment (no system site-packages).

metapatch, wrapt and packaging are copied into the new environment's site-packages (what an install
leaves there, without network or a build backend); "uninstall" deletes the copy. Every check runs a
fresh interpreter of that environment from a neutral directory, so only the .pth file can import
metapatch there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import metapatch
from metapatch.commands.enable import PTH_NAME

PROBE = "import sys; print('metapatch' in sys.modules)"


def _run(python, *args, cwd, env_extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "METAPATCH_AUTOLOAD", "METAPATCH_BOOTSTRAP_HOME", "METAPATCH_DISABLE")}
    env.update(env_extra or {})
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("enable")
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                        cwd=root).stdout.strip())
    import packaging
    import wrapt

    for module in (wrapt, packaging, metapatch):
        package_dir = Path(module.__file__).resolve().parent
        shutil.copytree(package_dir, purelib / package_dir.name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    neutral = root / "elsewhere"
    neutral.mkdir()
    return python, purelib, neutral


def test_enable_imports_metapatch_in_every_process_and_disable_undoes_it(venv):
    python, purelib, neutral = venv
    assert _run(python, "-c", PROBE, cwd=neutral).stdout.strip() == "False"  # nothing imports it yet

    dry = _run(python, "-m", "metapatch", "enable", "--dry-run", cwd=neutral)
    assert dry.returncode == 0 and str(purelib / PTH_NAME) in dry.stdout
    assert not (purelib / PTH_NAME).exists()

    enabled = _run(python, "-m", "metapatch", "enable", cwd=neutral)
    assert enabled.returncode == 0, enabled.stderr
    assert str(purelib / PTH_NAME) in enabled.stdout  # it says which file
    assert [p.name for p in purelib.glob("*.pth")] == [PTH_NAME]  # one file, nothing else

    child = _run(python, "-c", PROBE + "; import metapatch; print(metapatch.registry is not None)", cwd=neutral)
    assert child.stdout.split() == ["True", "True"], child.stderr
    assert child.stderr == ""
    assert _run(python, "-c", PROBE, cwd=neutral, env_extra={"METAPATCH_AUTOLOAD": "0"}).stdout.strip() == "False"

    disabled = _run(python, "-m", "metapatch", "disable", cwd=neutral)
    assert disabled.returncode == 0 and str(purelib / PTH_NAME) in disabled.stdout
    assert not (purelib / PTH_NAME).exists()
    assert _run(python, "-c", PROBE, cwd=neutral).stdout.strip() == "False"
    again = _run(python, "-m", "metapatch", "disable", cwd=neutral)
    assert again.returncode == 0 and "not enabled" in again.stdout


def test_interpreter_starts_when_metapatch_is_broken_or_uninstalled(venv):
    python, purelib, neutral = venv
    assert _run(python, "-m", "metapatch", "enable", cwd=neutral).returncode == 0
    installed = purelib / "metapatch"
    saved = purelib.parent / "metapatch-saved"
    shutil.copytree(installed, saved, symlinks=True)
    try:
        (installed / "__init__.py").write_text("raise RuntimeError('deliberately broken metapatch')\n")
        broken = _run(python, "-c", "print('started')", cwd=neutral)
        assert broken.returncode == 0 and broken.stdout.strip() == "started"
        assert "metapatch: not active (RuntimeError: deliberately broken metapatch)" in broken.stderr

        shutil.rmtree(installed)  # uninstalled, .pth left behind
        gone = _run(python, "-c", "print('started')", cwd=neutral)
        assert gone.returncode == 0 and gone.stdout.strip() == "started"
        assert gone.stderr == ""  # an uninstalled metapatch is not an error
    finally:
        if installed.exists():
            shutil.rmtree(installed)
        shutil.move(str(saved), str(installed))
    assert _run(python, "-m", "metapatch", "disable", cwd=neutral).returncode == 0


def test_enable_refuses_outside_a_virtual_env_unless_forced(tmp_path, monkeypatch, capsys):
    import argparse

    from metapatch.commands import enable

    monkeypatch.setattr(enable, "in_virtual_env", lambda: False)
    monkeypatch.setattr(enable, "site_packages", lambda: tmp_path)
    assert enable.run(argparse.Namespace(dry_run=False, force=False)) == 2
    assert "not a virtual environment" in capsys.readouterr().err
    assert not (tmp_path / PTH_NAME).exists()
    assert enable.run(argparse.Namespace(dry_run=False, force=True)) == 0
    assert (tmp_path / PTH_NAME).read_text().startswith("import os, sys; exec(")
