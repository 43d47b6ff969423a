"""Put first on a scenario child's path by ``metapatch survey`` (never shipped into a user's path).

With ``METAPATCH_SURVEY_FORCE=<patch id>`` it opens that patch's version gate and accepts any
source fingerprint of its targets, before any target module is imported: the survey asks "does
the patch's code fix this release?", also on releases the record does not list yet (a new code
variant is accepted into the record only after this run passes)."""

import os

_FORCED = os.environ.get("METAPATCH_SURVEY_FORCE", "").strip()


class _AnyFingerprint(tuple):
    def __contains__(self, item: object) -> bool:
        return True


if _FORCED:
    import metapatch

    _patch = metapatch.registry.patches.get(_FORCED)
    if _patch is not None:
        _patch.affects = {dist: "" for dist in _patch.affects}  # an empty specifier admits every version
        for _target in _patch.targets:
            _target.fingerprints = _AnyFingerprint(_target.fingerprints)
