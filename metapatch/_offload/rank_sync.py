"""Make every rank hold rank 0's tensors: the one collective the FSDP loading patches share.

Every rank calls :func:`broadcast_from_rank0` with the same model (same class and config); it first
agrees on what is sent (names, shapes, dtypes, and whether rank 0 has real data for each), so a
disagreement raises the same :class:`MetapatchError` on every rank instead of leaving one rank
blocked in a collective or reading a wrong-sized tensor. Imported only by patches, once torch is in.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Tuple

from metapatch._framework.records import MetapatchError

Entry = Tuple[str, Any, str, str]  # (qualified name, owning module, "param" | "buffer", local name)


def model_entries(model: Any, which: str = "all") -> List[Entry]:
    """Parameters and buffers in a deterministic order, each tensor once (ties keep their first
    name); ``which`` is "all" or "non-persistent"."""
    entries: List[Entry] = []
    seen = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if which == "all":
            for name, param in module._parameters.items():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    entries.append((prefix + name, module, "param", name))
        for name, buffer in module._buffers.items():
            if buffer is None or id(buffer) in seen:
                continue
            if which == "non-persistent" and name not in module._non_persistent_buffers_set:
                continue
            seen.add(id(buffer))
            entries.append((prefix + name, module, "buffer", name))
    return entries


def _current(entry: Entry) -> Any:
    _, module, kind, name = entry
    return (module._parameters if kind == "param" else module._buffers)[name]


def _comm_device(dist: Any) -> Any:
    import torch

    # nccl alone cannot send CPU tensors; accelerate's FSDP backend "cuda:nccl,cpu:gloo" can.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_rank0(model: Any, entries: Iterable[Entry], what: str) -> int:
    """Replace each entry's tensor on every rank != 0 with rank 0's value (in place where the rank
    holds real storage, keeping ties and optimizer references; a new tensor where it holds a meta
    placeholder, set at every module attribute that shared the placeholder). Returns the count."""
    import torch
    import torch.distributed as dist

    entries = list(entries)
    rank = dist.get_rank()
    mine = [(e[0], tuple(_current(e).shape), str(_current(e).dtype), not _current(e).is_meta) for e in entries]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    shapes = [[row[:3] for row in ranks] for ranks in gathered]
    if any(s != shapes[0] for s in shapes):
        differing = sorted({row[0] for ranks in shapes for row in ranks} - set.intersection(*(set(r) for r in shapes)))
        raise MetapatchError(f"metapatch: cannot give every rank rank 0's {what}: the ranks' models differ "
                             f"(names, shapes or dtypes){': ' + ', '.join(differing[:5]) if differing else ''}. "
                             "Load the same model class and config on every rank.")
    missing_on_0 = [row[0] for row in gathered[0] if not row[3]]
    if missing_on_0:
        raise MetapatchError(f"metapatch: rank 0 holds no data for {', '.join(missing_on_0[:5])}"
                             f"{' and more' if len(missing_on_0) > 5 else ''}; there is nothing to give the other "
                             f"ranks ({what}). Rank 0 must load the model with real weights.")
    device = _comm_device(dist)
    sharers = _sharers(model) if rank != 0 else {}
    for entry in entries:
        tensor = _current(entry)
        if rank == 0:
            dist.broadcast(tensor.detach().to(device), src=0)
            continue
        received = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        dist.broadcast(received, src=0)
        if not tensor.is_meta:
            with torch.no_grad():
                tensor.copy_(received)
            continue
        value = received.to("cpu")
        new = torch.nn.Parameter(value, requires_grad=tensor.requires_grad) if entry[2] == "param" else value
        for module, kind, name in sharers.get(id(tensor), [(entry[1], entry[2], entry[3])]):
            (module._parameters if kind == "param" else module._buffers)[name] = new
    return len(entries)


def _sharers(model: Any) -> Dict[int, List[Tuple[Any, str, str]]]:
    found: Dict[int, List[Tuple[Any, str, str]]] = {}
    for module in model.modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    found.setdefault(id(tensor), []).append((module, kind, name))
    return found


def marked(model: Any, attribute: str) -> bool:
    """Whether ``model`` or a module inside it (a PEFT or accelerate wrapper's base) carries ``attribute``."""
    modules: Callable[[], Iterable[Any]] = getattr(model, "modules", lambda: ())
    return any(getattr(module, attribute, False) for module in modules())
