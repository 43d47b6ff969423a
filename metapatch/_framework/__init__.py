"""The framework: patch records, the registry that installs them (gate, planning, sites, import hooks,
fingerprints, status), warnings and the upstream-diff files. Knows no patch and imports nothing of torch's
world: the layer below :mod:`metapatch._offload` and :mod:`metapatch.patches`."""
