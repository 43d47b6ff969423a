"""Sub-commands of the ``metapatch`` CLI, one module each (see metapatch.cli)."""
