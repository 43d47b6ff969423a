"""offloaded-outside-reads: a module's forward that reads another module's offloaded tensors directly
(``self.embed_tokens.weight[pad_id]``, ``x.to(self.embed_tokens.weight.device)``, ``x + self.child.bias``)
or calls a child's method other than ``forward`` (``self.experts.map(x)``) sees the real tensors, on the
execution device, for as long as that forward runs, and so does a model method other than ``forward`` called outside
any forward (``generate()`` calling ``get_image_features``, which reads LLaVA-NeXT's ``image_newline``); upstream it meets accelerate's meta placeholder
(``Tensor on device meta is not on the expected device``, ``Cannot copy out of meta tensor``, or wrong
numbers).

The mechanism (metapatch._offload.outside_reads) runs once per dispatch: when accelerate's top-level
``attach_align_device_hook_on_blocks`` (``dispatch_model``, so ``from_pretrained(device_map=...)``,
``load_checkpoint_and_dispatch``, PEFT's re-dispatch) or ``attach_align_device_hook`` (``cpu_offload``,
``disk_offload``) has attached offload hooks, the forward source of every module class is read once for
such reads, and only the modules that make them get a pre/post forward hook. A neighbour of the same bug
class is served at the same point, before the reads are looked for: a module's own tensors that the map
offloads under their own keys get an offload hook (accelerate hooks only the modules a map names:
ZayaModel's top-level parameters). (A disk-mapped tensor missing from a given offload index, MarianMT's
never-saved table, is accelerate-unindexed-disk-tensors'.) A write into a tensor held for such a read (in place, through
``.data``, under ``torch.inference_mode``, or a replacement) is kept by the offload store as the in-memory
model keeps it (metapatch._offload.offloaded_weights.materialised); a tied one is refused. Nothing changes
where nothing is offloaded (the call goes straight through).
"""

from __future__ import annotations

import threading
from typing import Any

from metapatch._framework.calls import signature_of
from metapatch._framework.records import Patch, Target, Upstream
from metapatch.patches._shared_targets import shared_fingerprints

PATCH_ID = "offloaded-outside-reads"

_depth = threading.local()


def _offloads(offload: Any) -> bool:
    if isinstance(offload, dict):
        return any(bool(v) for v in offload.values())
    return bool(offload)


def _attach(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    bound = signature_of(wrapped).bind_partial(*args, **kwargs)
    top = getattr(_depth, "value", 0) == 0 and not bound.arguments.get("module_name")
    _depth.value = getattr(_depth, "value", 0) + 1
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _depth.value -= 1
    module = bound.arguments.get("module")
    if top and module is not None and _offloads(bound.arguments.get("offload", False)):
        from metapatch._offload import outside_reads

        get = bound.arguments.get
        modules = list(module.named_modules())  # one walk for both passes (neither adds a module)
        outside_reads.hook_split_tensors(module, get("execution_device"), get("offload"), get("weights_map"),
                                          offload_buffers=get("offload_buffers", False), skip_keys=get("skip_keys"),
                                          tied_params_map=get("tied_params_map"), modules=modules)
        outside_reads.install(module, modules)
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="a forward that reads an offloaded module's tensors outside that module's own forward gets the "
          "real tensors (any architecture)",
    # Every accelerate release loads offloaded tensors only inside the owning module's forward; the
    # readers are in transformers' model code (see docs/sweep.md for the architectures measured).
    affects={"accelerate": ">=1.0"},
    targets=(
        Target("accelerate.hooks", "attach_align_device_hook_on_blocks",
               fingerprints=shared_fingerprints("accelerate.hooks:attach_align_device_hook_on_blocks"),
               wrapper=_attach, aliases=("accelerate.big_modeling:attach_align_device_hook_on_blocks",)),
        Target("accelerate.hooks", "attach_align_device_hook",
               fingerprints=("84415ff7ec011b1f",),  # accelerate 1.10.0 - 1.15.0
               wrapper=_attach, aliases=("accelerate.big_modeling:attach_align_device_hook",)),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/pull/48409",),
        forwarded="no",
        note="accelerate: dispatch_model finds forwards that read an offloaded child's tensors and "
             "keeps those children loaded while the reader runs; see the upstream diff",
    ),
)
