"""A 4-bit weight loaded by transformers 5.x can be offloaded by accelerate < 1.14 with bitsandbytes < 0.50.

accelerate moves an offloaded weight to meta, and back for each forward, by rebuilding the
parameter as ``Params4bit(data, requires_grad=..., **old_param.__dict__)``. transformers 5.x marks
every loaded parameter with ``param._is_hf_initialized = True``, so that dict carries a key
``Params4bit.__new__`` does not accept before bitsandbytes 0.50.0 (which added ``**kwargs``):
``dispatch_model`` of a 4-bit model with cpu/disk layers, and transformers' own dispatch, fail
with ``TypeError: Params4bit.__new__() got an unexpected keyword argument '_is_hf_initialized'``.
accelerate 1.14.0 fixed it from its side (it pops ``_is_hf_initialized`` before the call).

The replacement does what 0.50.0 does: ``Params4bit.__new__`` ignores keyword arguments it does
not know. Those are attributes other libraries attached to the old parameter object; none of
them describes the quantized data (the data and its quant state are named arguments), and
bitsandbytes' own ``Params4bit.to`` drops them in every release, so nothing computed changes.
"""

from __future__ import annotations

import functools
from typing import Any

from metapatch._framework.calls import keyword_names
from metapatch._framework.records import Patch, Target, Upstream


def _accepting_extra_keywords(original: Any) -> Any:
    known = keyword_names(original)

    @functools.wraps(original)
    def __new__(cls: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - it is __new__
        if not known.issuperset(kwargs):
            kwargs = {name: value for name, value in kwargs.items() if name in known}
        return original(cls, *args, **kwargs)

    return __new__


PATCH = Patch(
    id="bnb-params4bit-extra-attributes",
    title="bitsandbytes < 0.50 Params4bit accepts the attributes transformers 5.x sets on a parameter "
          "(accelerate offload of 4-bit weights)",
    # Measured with accelerate's dispatch_model of a 4-bit tiny Llama with disk layers
    # (selftest bnb-params4bit-extra-attributes/dispatch-as-loaded, and end to end
    # bnb-quant-state-offload/peft-lora-over-offloaded): TypeError unpatched, passes patched, on
    # transformers 5.0.0 x accelerate 1.12.0 x bitsandbytes 0.46.1 and transformers 5.2.0 x
    # accelerate 1.11.0 x bitsandbytes 0.47.0. Absent (passes unpatched) on transformers 4.57.x (it
    # sets no attribute on parameters; accelerate 1.10.x/1.14.0 with bitsandbytes 0.46.1, 0.48.2,
    # 0.49.2), on accelerate 1.14.0 (transformers 5.17.0 x bitsandbytes 0.49.2: accelerate pops
    # the attribute) and on bitsandbytes 0.50.x (**kwargs). 0.46.0 is not loadable for 4-bit by
    # transformers 5.x (it requires >= 0.46.1). Survey (docs/survey/): every transformers minor series
    # from 4.57 to 5.24 run with accelerate 1.13.0 x bitsandbytes 0.49.2 (4.57.6 absent, 5.0.0-5.24.0
    # TypeError, all patched pass) and every accelerate series 1.10-1.15 with transformers 5.24.0
    # (1.10.1-1.13.0 TypeError, 1.14.0/1.15.0 absent).
    affects={"bitsandbytes": ">=0.46.1,<0.50.0", "transformers": ">=5.0.0", "accelerate": "<1.14.0"},
    targets=(
        Target("bitsandbytes.nn.modules", "Params4bit.__new__",
               fingerprints=(
                   "740c418d4aa303b4",  # bitsandbytes 0.46.1
                   "86cb5b2372fafca5",  # bitsandbytes 0.47.0 and 0.48.2
                   "f139b1f1915a8dcd",  # bitsandbytes 0.49.2
                   "7d7b65c98712ad6e",  # bitsandbytes 0.49.0, 0.49.1 (ROCm blocksize default; measured on 0.49.0)
               ),
               replacement=_accepting_extra_keywords),
    ),
    upstream=Upstream(
        bug=("https://github.com/bitsandbytes-foundation/bitsandbytes/blob/0.50.0/bitsandbytes/nn/modules.py",),
        forwarded="not-needed",
        fixed_in={"bitsandbytes": "0.50.0", "accelerate": "1.14.0"},
        note="bitsandbytes 0.50.0 added **kwargs to Params4bit.__new__ (this backports it); accelerate "
             "1.14.0 pops _is_hf_initialized before rebuilding the parameter.",
    ),
)
