"""Tensors of an offloaded module read outside that module's own forward, for any architecture.

accelerate loads an offloaded module's weights only inside the module's own forward (its
``AlignDevicesHook``). Model code that reads them elsewhere meets the meta placeholder: a parent's
forward reading ``self.embed_tokens.weight[pad_id]`` or ``x + self.child.bias``, placing inputs by
``self.embed_tokens.weight.device``, or calling a child's method other than ``forward``
(``self.experts.map(x)``), whose body reads the child's own tensors.

At dispatch, once per model, every module's class ``forward`` source is read (once per class, cached)
for ``self.<child>...<tensor>`` chains and ``self.<child>...<method>(...)`` calls; a called method is
read the same way, relative to the module it is called on (a few levels deep). Each chain is resolved on
the live module tree: a chain ending on a parameter or buffer of another module is a read outside that
module's hook. The reader gets a torch forward pre-hook and an always-called forward hook that keep
those modules materialised (metapatch._offload.offloaded_weights.materialised: the accelerate hook's own
``pre_forward`` / ``post_forward``) for the duration of the reader's forward, so the reads see the
real tensors on the execution device and memory is held only while the reader runs. Modules that read
nothing outside get no hook: no per-op cost. A read whose tensor is on meta with no accelerate hook to
load it from raises a MetapatchError naming the reader and the tensor; so does a module whose own forward
would run on its own unloaded parameters (a map that split a module's parameters across devices:
accelerate hooks modules, so a parameter key on disk beside a sibling elsewhere is never loaded, and the
forward computes on the placeholder). Reads the source does not spell as ``self.<chain>`` (``getattr``, a module passed to a helper) are not found: they fail as before.

:func:`hook_split_tensors`, run first at the same dispatch, serves the other way a module's own tensors go
unloaded: a map that offloads them under their own keys (ZayaModel's top-level parameters) names no module
for accelerate to hook, so such a module gets an offload hook for its direct tensors.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import textwrap
from typing import Any, Dict, List, Optional, Tuple

from metapatch._offload.hook_state import holds, offload_hooks
from metapatch._offload.offloaded_weights import materialised
from metapatch._offload.store import Overlay
from metapatch._framework.records import MetapatchError

_DEPTH = 3
_ATTR = "_metapatch_outside_reads"
_METADATA = frozenset({"dtype", "shape", "ndim", "size", "dim", "numel", "is_floating_point", "requires_grad",
                       "is_complex", "element_size", "nelement"})


class OffloadedReadError(MetapatchError, RuntimeError):
    """A module's forward reads another module's tensor that is on meta and that nothing can load."""


@functools.lru_cache(maxsize=None)
def _chains(function: Any) -> Tuple[Tuple[Tuple[str, ...], bool], ...]:
    """Every maximal ``self.a.b...`` chain in ``function``'s source, with whether it is called."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)) or not definition.args.args:
        return ()
    self_name = definition.args.args[0].arg
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    inner = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain, current = [], node
        while isinstance(current, ast.Attribute):
            chain.append(current.attr)
            current = current.value
        if isinstance(current, ast.Name) and current.id == self_name:
            found.add((tuple(reversed(chain)), id(node) in called))
    return tuple(sorted(found))


@functools.lru_cache(maxsize=None)
def _module_api() -> frozenset:
    return frozenset(dir(sys.modules["torch.nn"].Module))


def _reads(reader: Any, module: Any, method: str, depth: int, seen: set, out: Dict[int, Tuple[Any, List[str]]],
           called: Optional[Dict[int, Any]] = None) -> None:
    """Collect into ``out`` (id -> (module, tensor names)) what ``module.<method>`` reads of modules other
    than ``reader``, and into ``called`` (id -> module) the other modules whose own methods it calls."""
    key = (id(module), method)
    if key in seen or depth > _DEPTH:
        return
    seen.add(key)
    function = inspect.getattr_static(type(module), method, None)
    if isinstance(function, (staticmethod, classmethod)):
        function = function.__func__
    if not callable(function):
        return
    torch_module = sys.modules["torch.nn"].Module
    for chain, is_call in _chains(function):
        current = module
        for position, name in enumerate(chain):
            if not isinstance(current, torch_module):
                break
            if name in current._parameters or name in current._buffers:
                # .dtype/.shape of the meta placeholder are the real ones: only values and .device need the tensor
                metadata_only = position + 1 < len(chain) and chain[position + 1] in _METADATA
                if current is not reader and not metadata_only:
                    out.setdefault(id(current), (current, []))[1].append(name)
                break
            if name in current._modules:
                current = current._modules[name]
                continue
            last = position == len(chain) - 1
            if is_call and last and name not in ("forward", "__call__") and name not in _module_api():
                # The method may read its module's own tensors in ways no chain spells (ProphetNet's
                # position_embeddings._forward is super().forward(...), nn.Embedding's, on its weight):
                # the whole module stays loaded while the reader runs.
                if current is not reader and called is not None:
                    called.setdefault(id(current), current)
                _reads(reader, current, name, depth + 1, seen, out, called)
            break


def _covering_hook_owner(module: Any, root: Any, names: Dict[int, str]) -> Optional[Any]:
    """``module`` when it has its own offload hook, else an ancestor whose hook places submodules."""
    if offload_hooks(module):
        return module
    path = names.get(id(module))
    while path:
        path = path.rpartition(".")[0]
        ancestor = root.get_submodule(path) if path else root
        if any(getattr(hook, "place_submodules", False) for hook in offload_hooks(ancestor)):
            return ancestor
    return None


def _add_holder(owners: List[Any], module: Any, root: Any, names: Dict[int, str]) -> None:
    """Add the module whose hook can load ``module``'s tensors to ``owners``, once (none: nothing to add)."""
    holder = _covering_hook_owner(module, root, names)
    if holder is not None and all(holder is not o for o in owners):
        owners.append(holder)


class _Reader:
    """The hooks of one reading module: the modules it keeps materialised while its forward runs, and
    the tensors it reads (checked after materialising: still on meta means nothing could load them)."""

    def __init__(self, reader_name: str, owners: List[Any], reads: List[Tuple[str, Any, str]]) -> None:
        self.reader_name = reader_name
        self.owners = owners
        self.reads = reads  # (dotted name, owning module, tensor name)
        self.stacks: List[contextlib.ExitStack] = []
        self.handles: List[Any] = []

    def pre(self, module: Any, args: Any) -> None:
        stack = contextlib.ExitStack()
        if any(offload_hooks(owner) for owner in self.owners):
            stack.enter_context(materialised(*self.owners))
        missing = [dotted for dotted, owner, tensor in self.reads
                   if getattr(owner._parameters.get(tensor, owner._buffers.get(tensor)), "is_meta", False)]
        if missing:
            stack.close()
            raise OffloadedReadError(
                f"metapatch: {type(module).__name__} ({self.reader_name or 'the model'}) reads {', '.join(missing)}, "
                f"which is on the meta device with no accelerate offload hook holding its value (read outside its "
                f"module's forward, or a device map that split a module's parameters across devices). Put that "
                f"whole module on one device in device_map, or load the model without offloading it.")
        self.stacks.append(stack)

    def post(self, module: Any, args: Any, output: Any) -> None:
        if self.stacks:
            self.stacks.pop().close()


def _unloaded_own_tensors(module: Any, model: Any, names: Dict[int, str]) -> List[Tuple[str, Any, str]]:
    """The module's own parameters left on meta with no offload hook to load them (a map that split a
    module's parameters across devices: accelerate hooks modules, not parameters)."""
    meta = [n for n, p in module._parameters.items() if p is not None and p.is_meta]
    if not meta or _covering_hook_owner(module, model, names) is not None:
        return []
    # Only what the forward reads: a tied copy's source left unhooked beside it (BertLMPredictionHead.bias,
    # which its decoder's hook loads under the decoder's own name) is never read there.
    # A forward that calls a method of its own (not a child's forward) may read them there: keep them all.
    forward = inspect.getattr_static(type(module), "forward", None)
    chains = _chains(forward) if callable(forward) else ()
    helpers = any(called and len(chain) == 1 and chain[0] not in module._modules for chain, called in chains)
    if chains and not helpers:
        read = {chain[0] for chain, _ in chains}
        meta = [n for n in meta if n in read]
    prefix = names.get(id(module), "")
    return [(f"{prefix}.{n}" if prefix else n, module, n) for n in meta]


def hook_split_tensors(model: Any, execution_device: Any, offload: Any, weights_map: Any,
                       offload_buffers: bool = False, skip_keys: Any = None, tied_params_map: Any = None,
                       modules: Optional[List[Tuple[str, Any]]] = None) -> List[str]:
    """Give an offload hook to every module whose own tensors a device map offloads under their own keys
    (``{"model.scale": "disk", "model.layers": "cpu"}``: ZayaModel's top-level parameters). accelerate
    hooks modules, not tensors, so upstream nothing loads those and they stay on meta. The hook serves the
    module's direct tensors from the weights map; a sibling the map keeps on a device is kept in CPU
    memory in front of that map (never in the offload folder), so one hook serves them all. A module with
    a direct tensor on meta that nothing holds is left alone (:func:`install` refuses its forward).
    Returns the names of the modules hooked; nothing happens where no such key is offloaded. ``modules``:
    ``model.named_modules()`` as a list, when the caller walks it for other passes too."""
    from collections.abc import Mapping

    if not isinstance(execution_device, Mapping) or not isinstance(offload, Mapping) or weights_map is None:
        return []
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from accelerate.utils import PrefixedDataset, named_module_tensors


    by_parent: Dict[str, set] = {}  # offloaded map keys by the module path they sit under
    for key, offloaded in offload.items():
        if offloaded:
            by_parent.setdefault(key.rpartition(".")[0], set()).add(key)
    hooked = []
    for name, module in modules if modules is not None else model.named_modules():
        own = by_parent.get(name)
        if not own or name in execution_device or offload_hooks(module):
            continue  # no key of its own offloaded, or hooked (or placed) by upstream as a whole
        prefix = f"{name}." if name else ""
        tensors = dict(named_module_tensors(module, include_buffers=offload_buffers, recurse=False,
                                            remove_non_persistent=True))
        served = {t for t in tensors if prefix + t in own and tensors[t].is_meta and holds(weights_map, prefix + t)}
        if not served or any(tensors[t].is_meta for t in tensors if t not in served):
            continue
        kept = {t: tensor.detach().to("cpu", copy=True) for t, tensor in tensors.items() if t not in served}
        prefixed = PrefixedDataset(weights_map, prefix)
        hook = AlignDevicesHook(execution_device=execution_device[prefix + sorted(served)[0]], offload=True,
                                weights_map=Overlay(prefixed, kept) if kept else prefixed,
                                offload_buffers=offload_buffers, skip_keys=skip_keys, tied_params_map=tied_params_map)
        add_hook_to_module(module, hook, append=True)  # its init puts the kept siblings on meta too
        hooked.append(name)
    return hooked


def install(model: Any, modules: Optional[List[Tuple[str, Any]]] = None) -> List[str]:
    """Give every module of ``model`` whose forward reads an offloaded module's tensors the hooks that
    serve those reads; returns the readers' names. Idempotent (a re-dispatch replaces earlier hooks).
    ``modules``: ``model.named_modules()`` as a list, when the caller has walked it already."""
    modules = list(model.named_modules()) if modules is None else modules
    names = {id(module): name for name, module in modules}
    readers = []
    for name, module in modules:
        old = module.__dict__.pop(_ATTR, None)
        if old is not None:
            for handle in old.handles:
                handle.remove()
        out: Dict[int, Tuple[Any, List[str]]] = {}
        called: Dict[int, Any] = {}
        _reads(module, module, "forward", 0, set(), out, called)
        owners, reads = [], []
        for owner, tensors in out.values():
            meta = sorted({t for t in tensors
                           if getattr(owner._parameters.get(t, owner._buffers.get(t)), "is_meta", False)})
            if not meta:
                continue  # on a device already: the read works without help
            reads.extend((f"{names.get(id(owner), '?')}.{t}", owner, t) for t in meta)
            _add_holder(owners, owner, model, names)
        for callee in called.values():  # served when a hook can load them; never refused on a guess
            if any(t is not None and t.is_meta for t in (*callee._parameters.values(), *callee._buffers.values())):
                _add_holder(owners, callee, model, names)
        # A module's own forward meeting its own unloaded weight is the same unservable read.
        reads.extend(_unloaded_own_tensors(module, model, names))
        if not reads and not owners:
            continue
        reader = _Reader(name, owners, reads)
        reader.handles = [module.register_forward_pre_hook(reader.pre),
                          module.register_forward_hook(reader.post, always_call=True)]
        module.__dict__[_ATTR] = reader
        readers.append(name)
    return readers
