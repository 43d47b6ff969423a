"""bitsandbytes 4-bit weights survive accelerate cpu/disk offload (meta-safe ``QuantState``).

accelerate offloads a weight by moving it to meta and reloads it before each forward as
``Params4bit(offloaded_data, **meta_param.__dict__).to(device)``: the quant state the reload uses
is the meta parameter's. Upstream ``QuantState.to("meta")`` moves ``absmax``, ``code``, ``offset``
and ``state2`` to meta in place, so the reload has nothing to copy ("Cannot copy out of meta
tensor") and ``as_dict`` crashes on ``offset.item()`` (double quant). Here the move to meta keeps
a host copy of the state (the small tensors and the nested offset scalar), the move back restores
from it, and serialization of a meta state either uses the true scalar or refuses by name.
"""

from __future__ import annotations

import copy
from typing import Any

from metapatch._framework.records import MetapatchError, Patch, Target, Upstream

# The host copy a meta QuantState restores from. Taken once, at the first move to meta, and kept
# across restore/offload cycles: the offloaded weight is reloaded in the format it had then, so
# the quant state must be too (CPU repacking mutates the live state in place at each forward).
HOST_ATTR = "_metapatch_host_state"
_TENSOR_FIELDS = ("absmax", "code", "offset")


def _device_of(args: tuple, kwargs: dict) -> Any:
    import torch

    device = kwargs.get("device", args[0] if args else None)
    if device is None:
        return None
    return device if isinstance(device, torch.device) else torch.device(device)


def _is_meta(state: Any) -> bool:
    absmax = state.__dict__.get("absmax")
    return getattr(absmax, "is_meta", False)


def _host_copy(state: Any) -> Any:
    """A QuantState with the same fields, its tensors on the CPU (no copy when already there)."""
    host = copy.copy(state)
    host.__dict__.pop(HOST_ATTR, None)
    for name in _TENSOR_FIELDS:
        value = host.__dict__.get(name)
        if value is not None:
            setattr(host, name, value.detach().to("cpu"))
    state2 = host.__dict__.get("state2")
    if state2 is not None:
        host.state2 = _host_copy(state2)
    return host


def _restore_into(state: Any, host: Any, device: Any) -> None:
    """Rebuild ``state`` in place (a Params4bit, its module and accelerate's offloaded copy may all
    share it) from the host copy, its tensors on ``device``: meta on offload, real on reload."""
    fields = dict(host.__dict__)
    for name in _TENSOR_FIELDS:
        if fields.get(name) is not None:
            fields[name] = fields[name].to(device)
    if fields.get("state2") is not None:
        state2 = copy.copy(fields["state2"])
        _restore_into(state2, fields["state2"], device)
        fields["state2"] = state2
    state.__dict__.clear()
    state.__dict__.update(fields)
    state.__dict__[HOST_ATTR] = host


def _follow_live_dtype(state: Any, host: Any) -> None:
    """bitsandbytes 0.49.x's ``matmul_4bit`` sets ``quant_state.dtype`` to the input's dtype at
    every CPU forward, in place: an in-memory layer then carries (and serializes) that dtype. The
    host copy follows it so that an offloaded layer stays identical to the in-memory one (seen
    with transformers 4.57, which loads 4-bit models in float16 while computing in float32). Not
    for a CPU-repacked state: there ``dtype`` is part of the repacked layout, which
    ``_save_to_state_dict`` undoes from ``original_dtype``."""
    live = state.__dict__.get("dtype")
    if live is not None and not state.__dict__.get("packing_format_for_cpu", False) and live != host.dtype:
        host.dtype = live


def quant_state_to(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    device = _device_of(args, kwargs)
    if device is None:
        return wrapped(*args, **kwargs)
    if device.type == "meta":
        host = instance.__dict__.get(HOST_ATTR)
        if host is None and _is_meta(instance):
            return wrapped(*args, **kwargs)  # already meta, nothing to keep
        if host is not None and not _is_meta(instance):
            _follow_live_dtype(instance, host)
        # The meta state mirrors the host copy, not the live layout: a CPU-repacked state (the
        # last forward's) would otherwise be "un-repacked" on meta by _save_to_state_dict.
        _restore_into(instance, host if host is not None else _host_copy(instance), device)
        return None
    if _is_meta(instance):
        host = instance.__dict__.get(HOST_ATTR)
        if host is None:
            raise MetapatchError(
                "a bitsandbytes 4-bit QuantState on the meta device has no host copy to restore "
                f"to {device} from: it was moved to meta before metapatch was imported, or built "
                "on meta. Import metapatch before loading/dispatching the model (metapatch "
                "patch 'bnb-quant-state-offload').")
        _restore_into(instance, host, device)
        return None
    return wrapped(*args, **kwargs)


def quant_state_as_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not _is_meta(instance) and not getattr(instance.__dict__.get("offset"), "is_meta", False):
        return wrapped(*args, **kwargs)
    host = instance.__dict__.get(HOST_ATTR)
    if host is not None:
        if getattr(host, "packing_format_for_cpu", False):
            # Linear4bit un-repacks a live state together with its weight before saving; the
            # weight of this one is offloaded, so the portable format cannot be rebuilt here.
            raise MetapatchError(
                "cannot serialize a bitsandbytes 4-bit QuantState that was offloaded in bitsandbytes' "
                "CPU-repacked format: its portable form needs the weight, which is offloaded; "
                "refusing to write it in a format a checkpoint cannot hold. Take the state dict with "
                "accelerate.utils.modeling.get_state_dict_offloaded_model(model), which reloads each "
                "offloaded weight first (metapatch patch 'bnb-quant-state-offload').")
        # The host copy is the true state of the offloaded weight (the format it was offloaded
        # in), so serializing it loses nothing; the meta tensors would be placeholders.
        return wrapped.__func__(host, *args, **kwargs)
    if instance.__dict__.get("nested"):
        raise MetapatchError(
            "cannot serialize a bitsandbytes 4-bit QuantState whose nested_offset (the double-quant "
            "scalar) is on the meta device and was never recorded; refusing to write a placeholder "
            "value. Import metapatch before dispatching the model (metapatch patch "
            "'bnb-quant-state-offload').")
    return wrapped(*args, **kwargs)  # meta tensors stay meta: nothing is invented


def linear4bit_save_to_state_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return wrapped(*args, **kwargs)
    except MetapatchError as exc:
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        raise MetapatchError(f"parameter {prefix}weight: {exc}") from None


PATCH = Patch(
    id="bnb-quant-state-offload",
    title="bitsandbytes 4-bit weights survive accelerate cpu/disk offload (meta-safe QuantState)",
    # Measured (torch 2.13, CPU; the selftest scenarios fail unpatched with "Cannot copy out of meta
    # tensor" / "Tensor.item() cannot be called on meta tensors" and pass patched) on bitsandbytes
    # 0.46.1 (with transformers 4.57.1 and 5.0.0), 0.47.0 (5.2.0), 0.48.2 (4.57.6), 0.49.2 (4.57.6
    # and 5.17.0) and 0.50.2 (5.11.0, 5.24.0): each has the in-place QuantState.to("meta"). 0.46.0:
    # the same fingerprints as 0.46.1, and unrecoverable-offset-refused fails unpatched / passes
    # patched; its 4-bit load scenarios are n/a there (transformers 5.x requires >= 0.46.1). 0.46.x
    # quantizes only nf4 on the CPU, so fp4 is not run there. 0.45.5 cannot run 4-bit on the CPU at
    # all, so it was not verified. No fixed release yet: upper end open.
    affects={"bitsandbytes": ">=0.46.0"},
    targets=(
        # the same source in 0.46.0, 0.46.1, 0.47.0, 0.48.2, 0.49.2 and 0.50.2
        Target("bitsandbytes.functional", "QuantState.to", fingerprints=("ce33140496adb702",),
               wrapper=quant_state_to),
        Target("bitsandbytes.functional", "QuantState.as_dict",
               fingerprints=(
                   "842ca7fcf01993c9",  # 0.50.2
                   "a7e927095b82daba",  # 0.46.0, 0.46.1, 0.47.0, 0.48.2, 0.49.2
               ),
               wrapper=quant_state_as_dict),
        Target("bitsandbytes.nn.modules", "Linear4bit._save_to_state_dict",
               fingerprints=(
                   "bd3439b9a864beb1",  # 0.49.2, 0.50.2
                   "fcccc67292f23257",  # 0.46.0, 0.46.1, 0.48.2
                   "fd03c2806f41e5b5",  # 0.47.0
                   "525aaab53c718b80",  # 0.49.0, 0.49.1 (a None check 0.49.2 added; measured on 0.49.0)
               ),
               wrapper=linear4bit_save_to_state_dict),
    ),
    upstream=Upstream(
        bug=("https://discuss.huggingface.co/t/cpu-offloading-error-scenario/175522",),
        forwarded="no",
        note="No upstream issue found filed; bitsandbytes 0.50.2 (latest) is affected. The diff differs from "
             "this patch in two ways: it frees the host copy on an ordinary move of a state in use (neither "
             "CPU-repacked), where this patch keeps it for the state's lifetime; and it has no equivalent of "
             "_follow_live_dtype (only bitsandbytes 0.49.x's matmul_4bit rewrites quant_state.dtype).",
    ),
    diagnoses=("quant-state-meta",),  # metapatch.diagnose findings this fixes
)
