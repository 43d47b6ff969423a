"""``metapatch survey``: measure, per patch, which releases of its target distributions carry which
code variant of the patched objects, whether the bug reproduces there and whether the patch fixes it.

Modules:
  releases  the releases inside the support window (PyPI's JSON API) and their downloaded wheels
  static    fingerprints read from a wheel's (or an installed package's) source, without importing it
  variants  consecutive releases with identical fingerprints grouped into code variants
  runner    cached throw-away venvs per combination of versions, and the reproducer runs in them
  probe     what runs inside such a venv (``python -m metapatch.survey.probe``)
  table     the per-patch table: build, read, write, print, and check a Patch record against it

A patch's table is ``metapatch/survey/tables/<id>.json`` (:func:`metapatch._framework.layout.survey_table`).
Everything downloaded or measured is cached under ``$METAPATCH_SURVEY_CACHE`` (default
``~/.cache/metapatch/survey``), so an interrupted survey resumes where it stopped.
"""

from __future__ import annotations

import os
from pathlib import Path



def cache_dir() -> Path:
    root = os.environ.get("METAPATCH_SURVEY_CACHE", "").strip()
    path = Path(root) if root else Path.home() / ".cache" / "metapatch" / "survey"
    path.mkdir(parents=True, exist_ok=True)
    return path

