"""Tied-parameter groups, and device maps that keep each group on one device.

Shared by the transformers and accelerate ``infer_auto_device_map`` patches (and the repair of
explicit maps), so both sides agree on what is tied and on what a tied group costs. This module is
the one the patches import (``from .. import _tied_groups as tg``); the code lives by responsibility in

* :mod:`metapatch._offload.tied_members`: which parameters are tied (declared ties and tensor identity, merged;
  the first name of a group is its *anchor*), a size table counting each group once, and the
  offload-index entries of tied copies;
* :mod:`metapatch._offload.tied_placement`: :class:`Placement`, a map computed as if nothing were tied, moved
  or refined until every group sits on one device, never past a device's budget;
* :mod:`metapatch._offload.tied_maps`: checking a map (bytes per device, split groups, upstream's own map where
  it is sound) and running upstream's allocator on the tie-free problem.

Import-cheap: nothing from torch or the Hugging Face stack at module level.
"""

from __future__ import annotations

from .tied_maps import (all_tied_identically, bytes_per_device, clone_with_globals, map_is_sound, ordered,
                         sources_come_first, speed_order, split_groups, unplaced_parameters, upstream_map_if_sound)
from .tied_members import (Group, _declared_mappings, _UnionFind, all_parameters, dedupe_tied_sizes,
                            index_tied_members, tied_groups)
from .tied_placement import Placement, TiedGroupsSplitWarning, entry_of, split_pairs_message, warn_split_groups

__all__ = [
    "Group", "Placement", "TiedGroupsSplitWarning", "all_parameters", "all_tied_identically", "bytes_per_device",
    "clone_with_globals", "dedupe_tied_sizes", "entry_of", "index_tied_members", "map_is_sound", "ordered",
    "sources_come_first", "speed_order", "split_groups", "split_pairs_message", "tied_groups",
    "unplaced_parameters", "upstream_map_if_sound", "warn_split_groups", "_declared_mappings", "_UnionFind",
]
