"""Offloaded tensors that are in no weights map: the ones a checkpoint never holds.

A model's tensors that are not saved (MarianMT's sinusoidal ``embed_positions.weight``, listed in
``_keys_to_ignore_on_save``) are computed at load by the model's own ``_init_weights``. When the device map
puts such a module on disk, transformers builds the disk offload index from the checkpoint's keys, so the
tensor has no entry; it stays on meta (its init ran on meta), and the module's offload hook fails at the
first forward: ``KeyError: 'model.encoder.embed_positions.weight'``.

After dispatch, every offload hook's tensors are looked up in its weights map (by key, without loading).
Only a tensor the model declares never saved (``_keys_to_ignore_on_save``) is computed: any other key missing
from the map (a renamed or tied one, say) holds a checkpoint value that an init would silently replace. For
each such tensor, the owning model's ``_init_weights`` is run twice on a CPU stand-in of that tensor
(the torch random state saved and restored, so the user's random stream is unchanged). When both runs give
the same value (a table computed from the shape, not a random draw), that value is kept in CPU memory in
front of the hook's weights map (:func:`metapatch._offload_store.keep`; the offload folder is never
written). A random initialisation (two runs differ) or a model without ``_init_weights`` is left as
upstream leaves it: a copy of the in-memory model would hold another random draw, a third answer.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from metapatch._hook_state import holds, offload_hooks


def _initial_value(root: Any, module: Any, name: str, like: Any) -> Optional[Any]:
    """The value ``root._init_weights(module)`` gives ``module.<name>`` on CPU, when two runs agree."""
    import torch

    init = getattr(root, "_init_weights", None)
    table = module._parameters if name in module._parameters else module._buffers
    if not callable(init) or table.get(name) is not like:
        return None
    draws = []
    try:
        with torch.random.fork_rng(devices=[]):  # the user's random stream is left as it was
            for _ in range(2):
                stand_in = torch.empty(like.shape, dtype=like.dtype, device="cpu")
                table[name] = torch.nn.Parameter(stand_in, requires_grad=like.requires_grad) \
                    if isinstance(like, torch.nn.Parameter) else stand_in
                with torch.no_grad():
                    init(module)
                draws.append(table[name].detach().clone())
    except Exception:  # an init that cannot run on its own module: left as upstream leaves it
        return None
    finally:
        table[name] = like  # the placeholder back: the hook serves the value from now on
    if not torch.equal(draws[0], draws[1]):
        return None  # a random draw: the in-memory model holds another one
    return draws[0]


def serve_missing(model: Any, modules: Optional[List[Tuple[str, Any]]] = None) -> List[str]:
    """Keep, for every offload hook of ``model``, the computed value of each tensor its weights map lacks
    (see the module docstring); returns their qualified names. ``modules``: ``model.named_modules()`` as a
    list, when the caller walks it for other passes too."""
    from metapatch._offload_store import hook_tensors, keep

    never_saved = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    if not never_saved:
        return []
    served: List[str] = []
    for prefix, module in modules if modules is not None else model.named_modules():
        for hook in offload_hooks(module):
            if hook.weights_map is None:
                continue
            for name, tensor in hook_tensors(module, hook):
                qualified = f"{prefix}.{name}" if prefix else name
                # (a store metapatch cannot look into is trusted to hold it: nothing is computed then)
                if not tensor.is_meta or qualified not in never_saved or holds(hook.weights_map, name):
                    continue
                owner_name, _, local = name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                value = _initial_value(model, owner, local, tensor)
                if value is not None:
                    keep(hook, name, value)
                    served.append(qualified)
    return served
