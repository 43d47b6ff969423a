"""transformers-fsdp2-keep-full-weight-reshard: a model that ``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=N))`` sharded with FSDP2 gives its sharded parameters
to an optimizer built after a forward outside autograd (evaluation, ``torch.no_grad``).

transformers' FSDP plan marks the final norm and ``lm_head`` (the input embedding where the head is
tied) ``keep_full_weight``: ``fully_shard(..., reshard_after_forward=False)``, and the root group
never reshards after forward either (torch's default for the root). FSDP2 registers a group's
unsharded parameters on its modules while it is unsharded, and a forward that no backward follows
leaves them there, so ``model.parameters()`` after an evaluation forward yields plain full tensors
for those modules instead of their sharded DTensors. An optimizer built then holds tensors that never
get a gradient (the backward reduce-scatters into the DTensors and registers those again): norm and
head are silently never trained. Two ranks, one SGD step at lr 0.5: logits 1.24 off the
single-process step (tiny Llama), 5.28 (tied Qwen2); no error. ``Trainer`` reshards before it builds
its optimizer (5.24); a loop of one's own does not. pytorch/pytorch#149205 reports the same effect
in plain FSDP2, where the root group staying unsharded after forward is by design
(pytorch/pytorch#131965).

After a forward of a model transformers sharded, with autograd off, the hook installed here reshards
every FSDP module of the model (``FSDPModule.reshard``: not recursive, a no-op on groups already
sharded), so the sharded parameters are registered again before anything can read
``parameters()``. With autograd on, nothing changes (the backward reshards; resharding there would
only cost the all-gather ``keep_full_weight`` saves). The cost: the next forward all-gathers those
groups again, as the other groups do anyway. A model loaded without ``distributed_config`` (or without
FSDP in it) never reaches the wrapped function.

Not covered: a forward with autograd on that no backward follows (the graph is kept alive), then an
optimizer built from ``parameters()``: the unsharded tensors are registered at that point as upstream
leaves them. Call ``module.reshard()`` on the FSDP modules first, as ``Trainer`` does.
"""

from __future__ import annotations

from typing import Any, List

from metapatch._framework.records import Patch, Target, Upstream

PATCH_ID = "transformers-fsdp2-keep-full-weight-reshard"
_HOOKED = "_metapatch_fsdp_reshard_hook"


def _fsdp_modules(model: Any) -> List[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _reshard_outside_autograd() -> Any:
    """A forward hook for the root: registered after FSDP2's own post-forward hook, so it runs when
    every group is idle again (``reshard`` of a group still in its forward does nothing)."""
    import torch

    modules: List[Any] = []

    def hook(module: Any, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            return
        if not modules:  # the groups are final once loaded: one walk, at the first such forward
            modules.extend(_fsdp_modules(module))
        for fsdp_module in modules:
            fsdp_module.reshard()

    return hook


def _apply_fsdp(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    model = wrapped(*args, **kwargs)
    if model is not None and not getattr(model, _HOOKED, False):
        model.register_forward_hook(_reshard_outside_autograd())
        setattr(model, _HOOKED, True)
    return model


PATCH = Patch(
    id=PATCH_ID,
    title="transformers native FSDP2 (from_pretrained(distributed_config=...)) reshards after a forward "
          "outside autograd (an optimizer built after an evaluation forward trains norm and lm_head)",
    # Measured (two ranks, gloo, torch 2.13.0): 5.17.0 and 5.24.0 affected, and by `metapatch survey
    # --run` 5.18.0, 5.20.1, 5.22.2 (the newest of each code variant). 5.15 is the first release
    # that shards at load time (5.14 defines the function but never calls it).
    affects={"transformers": ">=5.15"},
    targets=(
        Target("transformers.distributed.fsdp", "apply_fully_sharded_data_parallelism",
               fingerprints=("efcbca7e0634ea62",  # transformers 5.15.0 - 5.18.0
                             "0a4b98e873de8831",  # 5.19.0 - 5.20.1
                             "bfb5735f735b933f",  # 5.20.2 - 5.22.2
                             "22b31dd66fa0ee76"),  # 5.23.0, 5.24.0
               wrapper=_apply_fsdp,
               aliases=("transformers.distributed.mixin:apply_fully_sharded_data_parallelism",)),
    ),
    upstream=Upstream(
        bug=("https://github.com/pytorch/pytorch/issues/149205",),
        forwarded="no",
        note="transformers: apply_fully_sharded_data_parallelism registers a root forward hook that "
             "reshards the model's FSDP modules after a forward with autograd off",
    ),
)
