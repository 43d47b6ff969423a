"""offloaded-placeholder-writes: a write into an offloaded weight between forwards (``weight.data[i] = v``,
``torch.nn.init.zeros_(weight)``, ``weight.mul_(...)`` under ``no_grad``, a row of it, a part of its
``split``/``unbind``/``chunk``, a write through ``weight.detach()``, ``set_``) reaches the
offload store and the next forward, or raises :class:`~metapatch._offload.offloaded_weights.OffloadedWriteError`;
upstream it vanishes silently.

accelerate keeps an offloaded parameter as a meta placeholder between forwards (every release of the support
window, measured on 1.13.0 and 1.16.0) and serves the value from its hook's ``weights_map``; torch accepts every
write into a meta tensor and does nothing. Textual inversion under diffusers' sequential offload
(``accelerate.cpu_offload``) writes the learned token's row through ``embedding.weight.data[token] = learned``;
re-initialising a head after ``from_pretrained(device_map=...)`` calls ``torch.nn.init`` on it: the model then
computes with the old values, with no error.

The offload hooks' ``init_hook`` and ``post_forward`` mark the placeholders they create, and every write into a
marked one is replayed on the stored value, copied onto the hook's execution device (where the in-memory weight is:
a random write draws from that device's generator), and kept in CPU memory in front of the hook's weights map
(:mod:`metapatch._offload.placeholder_writes`; the user's offload folder is never written): equal to the
in-memory model's write, and ``save_pretrained`` writes it. A write that cannot be kept (its source is itself a
placeholder, it changes shape or dtype, the weight is tied to more than one other module's or to one kept in memory)
raises; a tied pair of offloaded weights (a head tied to its input embedding) shares one placeholder, and a write
into it is kept for both hooks, as the one tensor it is in memory. Marking costs a class
assignment per offloaded parameter and forward; the marked class overrides ``.data`` and torch's writing and
viewing methods (``benchmarks/RESULTS.md``).

Replacing the placeholder is the same write by other means: ``module.weight = nn.Parameter(v)``,
``load_state_dict(..., assign=True)``, a parameter registered on an offloaded module after dispatch. Upstream the
hook's next load puts the stored value over the new tensor, silently (a registered one, which it never stored,
fails that load with ``KeyError``). Before every load (``pre_forward``: a forward, and every reader that loads
through the hook) a real tensor the hook did not load itself is kept for it to serve, the program's tensor itself,
so a later in-place write into it shows as in memory. A replaced tied weight is untied, as in memory (a re-tie
that puts the partner's own tensor there keeps that tensor); a replacement of a quantized class raises. The hook tags the tensors it loads, so a forward that raised before its ``post_forward`` leaves nothing
that would be taken for a replacement.

A forward's own write into what the hook loaded is the third way: BatchNorm in training mode updates its running
statistics in place (offloaded with ``offload_buffers=True``), and upstream ``post_forward`` drops them with the
loaded buffers, silently (``eval()`` then normalises with the stored statistics). The load remembers each tensor's
``_version`` (a training-mode module's buffers: their values, since BatchNorm's kernel moves no ``_version``), and
``post_forward`` keeps a written one in the store first (:mod:`metapatch._offload.forward_writes`).

With ``offload_buffers=True`` the buffers' placeholders are marked as the parameters' are: ``reset_running_stats()``
between forwards (a BatchNorm recalibration starts with it) reaches the store.

torch's in-place *functions* given the placeholder write it as its methods do (``torch.relu_(w)``,
``torch.add(a, b, out=w)``, ``torch._foreach_mul_`` over a parameter list, each placeholder's entry on its own),
and so do the ``torch.nn.init`` functions that since torch 2.13 return at once on a meta tensor (``trunc_normal_``,
``orthogonal_``, ``dirac_``, ``sparse_``: run on the stored value on the execution device, so a random one draws
the in-memory weight's numbers from that device's generator). A ``state_dict()``
entry of a placeholder aliases it, as in memory (``model.state_dict()[k].copy_(v)``); one taken before a forward
(which puts new placeholders in place) raises. The marked class's ``__torch_function__`` calls torch's disabled
override directly; while the hook loads the values (``pre_forward``) each placeholder is of a quiet sibling class
without it, so accelerate's eight reads of each are C calls (they cost about 25 us per offloaded parameter and
forward through Python), and it is marked again when the load returns (a reference held to it still refuses).

A bitsandbytes 4-bit weight's placeholder (``Params4bit``) is marked too (a subclass of the same name: accelerate
rebuilds quantized parameters by class name): a write into its packed bytes (``weight.data.zero_()``, a row of bytes,
``copy_`` of packed bytes) is replayed on the stored bytes, and the next forward serves them with the layer's quant
state, which no write here changes (``bnb-cpu-repack-copy`` rebuilds its repacked copy after a kept write).

Hooks attached before metapatch was imported (a model dispatched, then ``import metapatch``) are found when the
patch applies (a walk of the garbage collector's objects, only then) and their placeholders marked; which of their
weights are tied metapatch did not see: a tie the model declares is a pair where both stores hold one tensor (refused
otherwise), weights served from one tensor in memory (``cpu_offload``) are a pair, accelerate's record holds where
``dispatch_model`` made the hooks, and a write into any other weight of such a hook held on disk is refused
(``OffloadedWriteError``: import metapatch first). Not seen: a forward's write through ``.data`` of what
it loaded.
A parametrization registered on an offloaded module
(``weight_norm``, ``spectral_norm``, ``orthogonal``) takes the placeholder as its original: upstream the module
then computes with meta values, silently wrong (``weight_norm``, ``spectral_norm``: logits off by 1e11 and more on
torch 2.13's CPU); with the placeholder marked the registration raises ``OffloadedWriteError``: ``spectral_norm``
and ``orthogonal`` write a meta value into it, ``weight_norm`` makes an ``nn.Parameter`` of it (refused: it would
hold no values; any ``nn.Parameter(placeholder)`` is). Register it before dispatching the model, or keep that module in memory.
"""

from __future__ import annotations

from typing import Any

from metapatch._framework.records import Patch, Target, Upstream
from metapatch._offload.forward_writes import keep_forward_writes, note_versions
from metapatch._offload.placeholder_writes import mark, note_ties, quieted, restored
from metapatch._offload.replaced_weights import adopt_replacements, note_loaded
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "offloaded-placeholder-writes"


def _module_of(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("module")


def _after_init_hook(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # tied weights are one object until the hooks split them; a module kept in memory counts as a holder too
    note_ties(_module_of(args, kwargs), instance)
    if not getattr(instance, "offload", False):
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    mark(_module_of(args, kwargs), instance)
    return result


def _around_pre_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not instance.offload:
        return wrapped(*args, **kwargs)
    module = _module_of(args, kwargs)
    # the reads of the placeholders from here to the end of the load (accelerate's, eight each): no Python call each
    switched = quieted(module, instance)
    try:
        adopt_replacements(module, instance)  # a tensor the program put in place of a placeholder: served from now on
        result = wrapped(*args, **kwargs)
    finally:
        restored(switched)
    note_loaded(module, instance)
    note_versions(module, instance)  # a write the forward makes into what was loaded is kept at its post_forward
    return result


def _after_post_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not instance.offload:
        return wrapped(*args, **kwargs)
    module = args[0] if args else kwargs["module"]
    try:
        keep_forward_writes(module, instance)  # before the placeholders go back (BatchNorm's running statistics)
    finally:
        result = wrapped(*args, **kwargs)  # offloaded again even where a write into a tied weight is refused
    mark(module, instance)  # a per-forward path: the modules are imported once, above (they import no torch)
    return result


def _adopt_hooks_attached_before(hooks_module: Any) -> None:
    # Applied after a model was dispatched (``import metapatch`` late): its placeholders are marked now, not at their
    # next forward, so a write before that forward is kept or refused too.
    from metapatch._offload.placeholder_writes import adopt_hooked_before

    adopt_hooked_before()


PATCH = Patch(
    id=PATCH_ID,
    title="A write into an offloaded weight between forwards (.data, torch.nn.init, in place under no_grad, the "
          "parameter replaced) or by its own forward (BatchNorm's running statistics) reaches the next forward or "
          "raises, instead of vanishing",
    # Measured: every write kind of the scenarios is a silent no-op on accelerate 1.13.0 and 1.16.0; the
    # placeholders are meta tensors by design in every release, so the range stays open.
    affects={"accelerate": ">=1.10.0"},
    targets=(
        Target("accelerate.hooks", "AlignDevicesHook.init_hook",
               fingerprints=shared_fingerprints("accelerate.hooks:AlignDevicesHook.init_hook"),
               wrapper=_after_init_hook),
        Target("accelerate.hooks", "AlignDevicesHook.pre_forward",
               fingerprints=("18fe6438772cedef",   # accelerate 1.10.0 - 1.11.0
                             "653a62460d8eb6d9",   # accelerate 1.13.0
                             "f285ac7a77158b23",   # accelerate 1.14.0 - 1.15.0
                             "4ba39112493d24e3"),  # accelerate 1.16.0
               wrapper=_around_pre_forward),
        Target("accelerate.hooks", "AlignDevicesHook.post_forward",
               fingerprints=("4200559c8ad6e85c",   # accelerate 1.10.0 - 1.12.0
                             "f14e50617773cfd9",   # accelerate 1.13.0 - 1.15.0
                             "2984b2e45429e374"),  # accelerate 1.16.0
               wrapper=_after_post_forward),
    ),
    wraps_over=("offloaded-move-guard",),
    adopt_existing=_adopt_hooks_attached_before,
    upstream=Upstream(
        bug=("https://github.com/huggingface/diffusers/issues?q=textual+inversion+cpu_offload",),
        forwarded="no",
        note="accelerate: offload hooks keep a write into an offloaded parameter's placeholder (an override the "
             "hook serves before its weights map) instead of letting it vanish into the meta tensor",
    ),
)
