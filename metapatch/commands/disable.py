"""``metapatch disable``: the other half of :mod:`metapatch.commands.enable`."""

from metapatch.commands.enable import DISABLE_HELP as HELP
from metapatch.commands.enable import add_disable_arguments as add_arguments
from metapatch.commands.enable import run_disable as run

__all__ = ["HELP", "add_arguments", "run"]
