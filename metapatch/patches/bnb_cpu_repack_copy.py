"""bitsandbytes' CPU repacking of a 4-bit weight goes into a separate inference copy.

On a CPU with AVX512-BF16, bitsandbytes >= 0.49 repacks a 4-bit weight for its fused CPU kernel
at the first forward in eval mode with an input that does not require grad (any
``torch.no_grad()`` evaluation), in place and for good: ``weight.data`` and its ``QuantState``
become the repacked layout (absmax in bfloat16, double quant undone). Afterwards

* every forward runs ``bitsandbytes::gemv_4bit``, which has no autograd kernel: after one
  evaluation, training gets no gradient to the layer's input, so QLoRA adapters below the last
  4-bit layer stay at ``grad None`` (PyTorch only warns);
* ``state_dict()`` / ``save_pretrained`` convert back lossily (absmax through bfloat16, double
  quant re-quantized): the saved checkpoint is not the loaded one;
* a weight whose shape the repack cannot take (out_features not a multiple of 32, in_features not
  a multiple of the blocksize) fails its first no-grad forward with an ``AssertionError``.

Here the layer keeps its portable form. Where upstream would repack, the forward runs on a
repacked copy (built once per weight tensor, kept while that tensor lives, so an in-memory layer
holds its 4-bit weight twice on such CPUs; an offloaded layer's copy goes with the reloaded
weight). Outputs are the ones the repacked kernel gives; training forwards and serialization see
the portable weight, untouched. Shapes the repack cannot take run the portable kernel. The copy is
rebuilt after a write into the weight: its ``.data`` moves the parameter's ``_version`` from the
first repacked forward on (a subclass of the same name; torch's ``.data`` has a counter of its own),
and writes kept for an offloaded weight's placeholder are counted per quant state object.

An accelerate-offloaded layer gets a new parameter at every forward, so it would be repacked at
every forward (a third of a dispatched 4-bit forward on such a CPU). For cpu offload its copy is
kept per offload source instead (the hook's weights-map entry and bnb-quant-state-offload's host
state), in RAM next to the offloaded weight. A weight on disk is still repacked at every forward,
as upstream does: keeping its copy would need RAM (undoing the offload) or a file written into the
user's offload folder, and metapatch writes nothing there. Its packed quant state is kept (absmax
in bfloat16: 1/16 of the 4-bit weight), and the weight read back at each forward is put into the
CPU layout with byte operations (:mod:`metapatch._offload.bnb_fast_repack`, proven equal to bitsandbytes'
conversion per shape), about 3 times faster than bitsandbytes' own repack.

The copy is swapped into the parameter for the duration of the call: two threads running the same
layer at once are not supported (as with upstream's own in-place repack).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Dict, Tuple

from metapatch._offload import bnb_fast_repack
from metapatch._offload.hook_state import DISK, locate, offload_hooks, weights_map_of
from metapatch._offload.write_replay import kept_writes
from metapatch._framework.records import MetapatchError, Patch, Target, Upstream

# The repack kernel's column block (bitsandbytes' default block_n) and the nf4/fp4 types it has.
_BLOCK_N = 32
_QUANT_TYPES = ("nf4", "fp4")
HOST_ATTR = "_metapatch_host_state"  # bnb-quant-state-offload's host copy: not part of a repack
# On an offloaded Linear4bit: (source identity, packed weight (None on disk), packed QuantState, source entry, host state).
OFFLOAD_CACHE = "_metapatch_offloaded_cpu_pack"
# id(Params4bit) -> (key, packed weight, packed QuantState, the portable state it came from); an entry goes when its parameter does.
_PACKED: Dict[int, Tuple[Tuple[Any, ...], Any, Any, Any]] = {}
_WATCHED: Dict[Any, Any] = {}  # bitsandbytes' Params4bit -> its subclass whose .data moves the parameter's _version


def _input(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("x")


def _upstream_would_repack(module: Any, x: Any, state: Any) -> bool:
    """The condition of upstream's in-place repack (read from the same attributes)."""
    return (getattr(x, "device", None) is not None and x.device.type == "cpu"
            and getattr(module, "support_avx512bf16_for_cpu", False)
            and not module.training and not x.requires_grad
            and not getattr(state, "packing_format_for_cpu", False))


def repackable(state: Any, weight: Any) -> bool:
    """Whether the repack keeps the layer's meaning: per-row absmax blocks, whole column blocks,
    and the weight holding exactly the bytes its shape needs."""
    shape = tuple(getattr(state, "shape", ()) or ())
    if len(shape) != 2 or state.quant_type not in _QUANT_TYPES or weight.device.type != "cpu":
        return False
    n, k = shape
    blocksize = state.blocksize
    return (n % _BLOCK_N == 0 and k % 2 == 0 and blocksize > 0 and k % blocksize == 0
            and weight.numel() * weight.element_size() * 2 == n * k)


def _key(weight: Any, state: Any) -> Tuple[Any, ...]:
    absmax = state.absmax
    # kept_writes: a write into an offloaded weight's placeholder, kept for the next forward (offloaded-placeholder-writes)
    return (weight.data_ptr(), weight._version, weight.dtype, id(state), absmax.data_ptr(), absmax._version,
            kept_writes(state))


def _watched_class(base: Any) -> Any:
    """bitsandbytes' ``Params4bit`` (``base``) whose ``.data`` shares the parameter's version counter, as
    ``detach()`` does. A repacked copy is valid while the weight's ``_version`` stays; torch's ``.data`` has a
    version counter of its own, so ``weight.data.zero_()`` after an evaluation would leave the copy stale, and the
    forward would compute with the bytes from before the write (upstream, repacking in place, sees it). A weight
    gets this class when its repacked copy is first made; a parameter built from it (accelerate's reload,
    ``copy.deepcopy``) is a plain ``base``, and the class keeps ``base``'s name, which accelerate and transformers
    dispatch on. Not seen: a write through a ``.data`` taken before that first repacked forward and held past it."""
    cls = _WATCHED.get(base)
    if cls is None:
        import torch

        detach, set_data = torch.Tensor.detach, torch._C.TensorBase.data.__set__

        class WatchedParams4bit(base):
            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                return base(*args, **kwargs)

            @property
            def data(self) -> Any:
                return detach(self)

            @data.setter
            def data(self, value: Any) -> None:
                set_data(self, value)

        WatchedParams4bit.__name__ = WatchedParams4bit.__qualname__ = base.__name__
        cls = _WATCHED[base] = WatchedParams4bit
    return cls


def _raw_data(weight: Any) -> Any:
    import torch

    return torch._C.TensorBase.data.__get__(weight)


def _packed_copy(weight: Any, state: Any) -> Tuple[Any, Any]:
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    key = _key(weight, state)
    entry = _PACKED.get(id(weight))
    if entry is not None and entry[0] == key and entry[3] is state:
        return entry[1], entry[2]
    fresh = entry is None
    work = copy.copy(state)  # the repack rebinds the state's fields; the portable ones stay as they are
    work.__dict__.pop(HOST_ATTR, None)
    packed, packed_state = _convert_weight_packed_for_cpu(_raw_data(weight), work)
    _PACKED[id(weight)] = (key, packed, packed_state, state)
    if fresh:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
        if type(weight).__name__ == "Params4bit" and type(weight) not in _WATCHED.values():
            weight.__class__ = _watched_class(type(weight))  # writes through .data now move its _version
    return packed, packed_state


def _weight_source(hook: Any) -> Tuple[Any, str, Any]:
    """(offload folder or None, the weight's key, its entry) where the hook's weights map holds the
    weight, or Nones: accelerate's disk loader keeps an index entry per weight, cpu offload the tensor."""
    found = locate(weights_map_of(hook), "weight")
    if found is None or (found.store == DISK and found.folder is None):
        return None, "", None
    return (found.folder if found.store == DISK else None), found.key, found.entry


def _offloaded_packed_copy(module: Any, hook: Any, weight: Any, state: Any) -> Any:
    """The repacked copy of an offloaded weight, made once per load of its offload source rather
    than at every forward (accelerate rebuilds the parameter at each one). Valid while the hook
    reads the same source entry and bnb-quant-state-offload restores the same host state (the
    format it was offloaded in). Only for cpu offload: on disk, a fresh copy every time."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    folder, key, entry = _weight_source(hook)
    host = state.__dict__.get(HOST_ATTR)
    if entry is None or host is None:
        return None
    identity = (id(hook), key, id(entry), kept_writes(state), id(host), weight.dtype, tuple(weight.shape))
    cached = module.__dict__.get(OFFLOAD_CACHE)
    if cached is not None and cached[0] == identity and cached[3] is entry and cached[4] is host:
        if cached[1] is not None:
            return cached[1], cached[2]
        # On disk: only the packed state is kept (absmax, 1/16 of the weight); the weight read back at
        # this forward is permuted into the CPU layout with byte operations (metapatch._offload.bnb_fast_repack).
        fast = bnb_fast_repack.packed_weight(weight.data, cached[2], _convert_weight_packed_for_cpu)
        if fast is not None:
            return fast, cached[2]
    work = copy.copy(state)
    work.__dict__.pop(HOST_ATTR, None)
    packed, packed_state = _convert_weight_packed_for_cpu(weight.data, work)
    # A weight on disk is not kept: a copy would have to live in RAM (undoing the offload) or in a file
    # metapatch writes into the user's offload folder. Only its packed state is, for the byte layout above.
    module.__dict__[OFFLOAD_CACHE] = (identity, None if folder is not None else packed, packed_state, entry, host)
    return packed, packed_state


def linear4bit_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    x = _input(args, kwargs)
    weight = getattr(instance, "weight", None)
    state = getattr(weight, "quant_state", None)
    if x is None or state is None:
        return wrapped(*args, **kwargs)
    if getattr(state, "packing_format_for_cpu", False):
        # Repacked in place before this patch was active: the portable form is gone (upstream's
        # inverse is lossy), and the repacked kernel has no backward.
        import torch

        if torch.is_grad_enabled() and x.requires_grad:
            raise MetapatchError(
                "this bitsandbytes 4-bit layer was repacked in place for the CPU kernel (at a no-grad "
                "forward before metapatch was active); that kernel has no backward, so gradients to "
                "its input (and to adapters below it) would be None. Import metapatch before the "
                "first forward, or reload the model (metapatch patch 'bnb-cpu-repack-copy').")
        return wrapped(*args, **kwargs)
    if not _upstream_would_repack(instance, x, state):
        return wrapped(*args, **kwargs)
    if not repackable(state, weight):
        # The portable kernel: what a CPU without AVX512-BF16 runs for the same layer.
        instance.support_avx512bf16_for_cpu = False
        try:
            return wrapped(*args, **kwargs)
        finally:
            instance.support_avx512bf16_for_cpu = True
    portable = _raw_data(weight)
    hooks = offload_hooks(instance)
    packed_pair = _offloaded_packed_copy(instance, hooks[0], weight, state) if hooks else None
    packed, packed_state = packed_pair if packed_pair is not None else _packed_copy(weight, state)
    weight.data, weight.quant_state = packed, packed_state
    try:
        return wrapped(*args, **kwargs)
    finally:
        weight.data, weight.quant_state = portable, state


PATCH = Patch(
    id="bnb-cpu-repack-copy",
    title="bitsandbytes' CPU repacking of a 4-bit weight goes into a separate inference copy (training "
          "after evaluation back-propagates, state_dict writes the loaded bytes, any shape runs)",
    # Measured on a CPU with AVX512-BF16 (torch 2.13), selftest bnb-cpu-repack-copy/*: unpatched a tiny
    # Llama nf4 double quant + LoRA gets grad None for 16 of 16 LoRA parameters after one no_grad forward,
    # save_pretrained after forwards changes 84 of 179 tensors (nf4 dq), offloaded layers with a
    # quant_storage other than uint8 or shapes off the repack block fail ("shape '[64, 64]' is invalid for
    # input of size 2048", "N must be divisible by block_n"), and PEFT over a dispatched uint8 Llama
    # differs from in memory; patched all equal, on bitsandbytes 0.49.2 (transformers 5.17.0, accelerate
    # 1.14.0) and 0.50.2 (5.24.0, 1.15.0). The CPU repack first shipped in 0.49.0 (0.46.0-0.48.2 have
    # no _convert_weight_packed_for_cpu: not affected); Linear4bit.forward is one variant over
    # 0.49.0-0.49.2 and one over 0.50.0-0.50.2 (survey, static). No fixed release: upper end open.
    affects={"bitsandbytes": ">=0.49.0"},
    targets=(
        Target("bitsandbytes.nn.modules", "Linear4bit.forward",
               fingerprints=(
                   "a252fb566767a343",  # 0.50.0, 0.50.1, 0.50.2
                   "a2daec5503259784",  # 0.49.0, 0.49.1, 0.49.2
               ),
               wrapper=linear4bit_forward),
    ),
    upstream=Upstream(
        bug=("https://github.com/bitsandbytes-foundation/bitsandbytes/blob/main/bitsandbytes/nn/modules.py",),
        forwarded="no",
        note="No upstream issue found filed; bitsandbytes 0.50.2 and main are affected. The diff passes the "
             "repacked copy to matmul_4bit where this patch swaps it into the parameter for the call, and it "
             "has no per-offload-source cache (accelerate rebuilds an offloaded parameter at every forward, "
             "so with the diff alone an offloaded layer is repacked at every forward, as upstream does today).",
    ),
)
