"""The CPU-kernel layout of a 4-bit weight, built with byte operations.

bitsandbytes' ``_convert_weight_packed_for_cpu`` widens every nibble of the weight to int32 before
moving it into the fused kernel's layout; the layout itself is a fixed permutation of nibbles (for a
column block of 32 rows: the high nibble of each output byte from the block's lower half, the low
one from its upper half). Here the same permutation is done on the packed bytes as uint8: about 3
times faster, which matters where the repack runs at every forward (a disk-offloaded layer: keeping
its repacked copy would need RAM or a file in the user's offload folder).

Only the weight is permuted here; the packed quant state still comes from bitsandbytes' own
conversion (once per offload source). The permutation is used for a shape only after it was proven
equal to bitsandbytes' on probe weights whose nibbles spell out their own position, one hexadecimal
digit per probe: equal outputs on every probe mean that every output nibble comes from the same
input position, so the two conversions agree on every weight of that shape. A shape that does not
prove equal (another bitsandbytes layout) keeps bitsandbytes' conversion.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional, Tuple

BLOCK_N = 32  # bitsandbytes' default block_n for the CPU layout
_PROVEN: Dict[Tuple[int, int, int], bool] = {}


def _permuted(data: Any, rows: int, cols: int) -> Any:
    """The CPU layout of ``data`` (the portable packed bytes of a ``rows`` x ``cols`` 4-bit weight)."""
    import torch

    blocks = data.reshape(-1).view(torch.uint8).reshape(rows // BLOCK_N, 2, BLOCK_N // 2, cols // 2)
    lower, upper = blocks[:, 0], blocks[:, 1]
    # The portable layout holds column 2j in the high nibble of byte j, column 2j+1 in the low one.
    even = (upper & 0xF0) | (lower >> 4)
    odd = (upper << 4) | (lower & 0x0F)
    return torch.stack((even, odd), dim=-1).transpose(1, 2).reshape(rows, cols // 2)


def _prove(rows: int, cols: int, blocksize: int, convert: Callable[[Any, Any], Tuple[Any, Any]]) -> bool:
    import torch
    from bitsandbytes.functional import QuantState

    # A quant state built directly (no quantizer call: the offload patches count those at reloads).
    state = QuantState(absmax=torch.ones((rows * cols) // blocksize), shape=torch.Size((rows, cols)),
                       blocksize=blocksize, quant_type="nf4", dtype=torch.bfloat16)
    position = torch.arange(rows * cols, dtype=torch.int64)
    digit = 0
    while digit == 0 or (rows * cols - 1) >> (4 * digit):
        nibbles = ((position >> (4 * digit)) & 0xF).to(torch.uint8).reshape(rows, cols)
        probe = ((nibbles[:, 0::2] << 4) | nibbles[:, 1::2]).reshape(-1, 1)
        try:
            expected, _ = convert(probe.clone(), copy.deepcopy(state))
        except Exception:  # noqa: BLE001 - a shape bitsandbytes refuses: keep its own path (and error)
            return False
        if not torch.equal(expected, _permuted(probe, rows, cols)):
            return False
        digit += 1
    return True


def packed_weight(data: Any, packed_state: Any, convert: Callable[[Any, Any], Tuple[Any, Any]]) -> Optional[Any]:
    """``data`` in the CPU layout that ``packed_state`` (bitsandbytes' conversion of its quant
    state) goes with, or None where the permutation is not proven for its shape."""
    shape = tuple(getattr(packed_state, "shape", ()) or ())
    if len(shape) != 2:
        return None
    rows, cols = int(shape[0]), int(shape[1])
    if rows % BLOCK_N or cols % 2 or data.numel() * data.element_size() * 2 != rows * cols:
        return None
    blocksize = int(getattr(packed_state, "blocksize", 0) or 0)
    if blocksize <= 0 or cols % blocksize:
        return None
    proven = _PROVEN.get((rows, cols, blocksize))
    if proven is None:
        proven = _PROVEN[(rows, cols, blocksize)] = _prove(rows, cols, blocksize, convert)
    return _permuted(data.contiguous(), rows, cols) if proven else None
