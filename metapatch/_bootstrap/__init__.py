"""Start-up hooks that make ``import metapatch`` happen in programs nobody edits.

This folder (not the package) goes first on ``PYTHONPATH`` under ``metapatch run``: its
``sitecustomize.py`` then runs in every Python process of the program's tree. It imports nothing
from metapatch at module level, so it works (and fails quietly) when metapatch cannot be imported.
"""

import os

BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(__file__))
HOME_ENV = "METAPATCH_BOOTSTRAP_HOME"  # where to find the metapatch package if sys.path does not
AUTOLOAD_ENV = "METAPATCH_AUTOLOAD"  # "0": the start-up hooks (run and enable) import nothing
