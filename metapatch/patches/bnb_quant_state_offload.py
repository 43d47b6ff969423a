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

from metapatch._records import MetapatchError, Patch, Target, Upstream

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


def quant_state_to(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    device = _device_of(args, kwargs)
    if device is None:
        return wrapped(*args, **kwargs)
    if device.type == "meta":
        host = instance.__dict__.get(HOST_ATTR)
        if host is None and _is_meta(instance):
            return wrapped(*args, **kwargs)  # already meta, nothing to keep
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
    # Checked with bitsandbytes 0.46.1, 0.47.0, 0.48.2, 0.49.2 and 0.50.2 (torch 2.13, CPU): each has
    # the in-place QuantState.to("meta") and fails both ways unpatched. 0.45.5 cannot run 4-bit on
    # the CPU at all, so it was not verified. No fixed release yet: upper end open.
    affects={"bitsandbytes": ">=0.46.1"},
    targets=(
        Target("bitsandbytes.functional", "QuantState.to", fingerprints=("ce33140496adb702",),
               wrapper=quant_state_to),
        Target("bitsandbytes.functional", "QuantState.as_dict",
               fingerprints=("842ca7fcf01993c9", "a7e927095b82daba"),
               wrapper=quant_state_as_dict),
        Target("bitsandbytes.nn.modules", "Linear4bit._save_to_state_dict",
               fingerprints=("bd3439b9a864beb1", "fcccc67292f23257", "fd03c2806f41e5b5"),
               wrapper=linear4bit_save_to_state_dict),
    ),
    upstream=Upstream(
        bug=("https://discuss.huggingface.co/t/cpu-offloading-error-scenario/175522",),
        forwarded="no",
        note="No upstream issue found filed; bitsandbytes 0.50.2 (latest) is affected.",
    ),
    diffs=("upstream_diffs/bnb-quant-state-offload/bitsandbytes.diff",),
    selftest="metapatch.selftest.bnb_offload",
)
