"""gguf's lazy tensors run every operation once on meta stand-ins (to learn the result's shape and
dtype) and again, later, on the real data. ``LazyBase._wrap_fn`` builds the meta pass's arguments
by replacing only the *lazy* arguments with their meta tensors; an eager tensor in the same call
stays on its device. llama.cpp's ``convert_hf_to_gguf.py`` does exactly that in ``dequant_bitnet``
(``lazy_weight >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)``), and torch refuses the meta pass:
"Tensor on device cpu is not on the expected device meta!".

The replacement wraps such eager tensors with the class's own ``from_eager`` before the original
``_wrap_fn`` sees them: a lazy tensor that already holds its data. The meta pass then gets its meta
stand-in like any lazy argument, and the real evaluation (``to_eager``) gets back the very eager
tensor, unchanged, so the result is the eager computation. gguf's own check in ``to_eager`` (the
real result's dtype and shape equal the meta result's) still runs. The original ``_wrap_fn`` is
called as it is, and the upstream diff makes the same change inside it.
"""

from __future__ import annotations

from typing import Any, Callable

from metapatch._framework.records import Patch, Target, Upstream


def eager_tensors_as_lazy(cls: Any, value: Any) -> Any:
    """``value`` with every eager tensor of ``cls``'s tensor type (in nested lists and tuples, the
    containers gguf recurses into) wrapped as a lazy tensor holding that data; the rest kept."""
    if isinstance(value, (list, tuple)):
        items = [eager_tensors_as_lazy(cls, item) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, cls._tensor_type) and not isinstance(value, cls):
        return cls.from_eager(value)
    return value


def build_wrap_fn(original: Any) -> Any:
    original_function = original.__func__  # the stored object is a classmethod

    def _wrap_fn(cls, fn: Callable, *, use_self: Any = None, meta_noop: Any = False) -> Callable:
        wrapped_fn = original_function(cls, fn, use_self=use_self, meta_noop=meta_noop)

        def wrapped_fn_taking_eager_tensors(*args: Any, **kwargs: Any) -> Any:
            # Keyword arguments are left alone: gguf <= 0.19 neither maps nor evaluates lazy
            # tensors passed by keyword, so wrapping one there would hand fn a lazy object.
            return wrapped_fn(*eager_tensors_as_lazy(cls, args), **kwargs)

        return wrapped_fn_taking_eager_tensors

    _wrap_fn.__doc__ = original_function.__doc__
    _wrap_fn.__wrapped__ = original_function
    _wrap_fn.__module__ = original_function.__module__
    _wrap_fn.__qualname__ = original_function.__qualname__
    return classmethod(_wrap_fn)


PATCH = Patch(
    id="gguf-lazy-eager-mix",
    title="gguf's lazy tensors give eager tensors in the same call meta stand-ins for the meta pass",
    # Measured on the PyPI wheels: LazyBase._wrap_fn maps only lazy arguments to meta in every
    # release that has it (0.9.1 ... 0.19.0, the latest). 0.10.0-0.16.0 share fingerprint
    # 79b57c0ad6ba9578; 0.16.2-0.19.0 share f9ae30f0d8ce255a (they add the shared evaluation of
    # tuple results, after the meta pass). 0.9.1 records args differently and is not covered.
    # Up to 0.16.0 binary operators skip the meta pass (meta_noop=True), so dequant_bitnet's `>>`
    # itself fails from 0.16.2 on; torch functions and tensor methods with an eager argument fail
    # in every release from 0.10.0 (the selftest runs both spellings).
    # No release fixes it: upper end open. llama.cpp's converter imports its checkout's own gguf-py:
    # master after 0.19.0 (which also maps lazy keyword arguments) has the same gap with another
    # fingerprint, not listed until a release carries it, so there the patch says stale.
    affects={"gguf": ">=0.10.0"},
    targets=(
        Target("gguf.lazy", "LazyBase._wrap_fn", fingerprints=("79b57c0ad6ba9578", "f9ae30f0d8ce255a"),
               replacement=build_wrap_fn),
    ),
    upstream=Upstream(
        bug=("https://github.com/ggml-org/llama.cpp/issues/25629",),
        forwarded="no",
        note="Seen converting microsoft/bitnet-b1.58-2B-4T with convert_hf_to_gguf.py (dequant_bitnet); "
             "the issue number is the one a user report cites, not checked against the tracker.",
    ),
)
