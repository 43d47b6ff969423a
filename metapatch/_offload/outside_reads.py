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

A module's own methods other than ``forward`` are entry points of the same kind: called from outside any forward
(``generate()`` calls ``model.base_model.get_image_features(...)`` before the first forward; a user calls
``model.get_image_features(pixel_values)``), one that reads the module's own offloaded tensors
(``self.image_newline`` of LLaVA-NeXT, ``self.query_tokens`` of BLIP-2) or a child's meets the placeholder, since
the module's hook loads them only in its forward. Each public method of model code (not torch's, accelerate's,
peft's, nor transformers' base classes') that reads an offloaded tensor gets an instance attribute of the same
name that holds those modules loaded while it runs (:class:`_EntryPoints`); called where they are loaded
already (inside a forward) it calls straight through.

:func:`hook_split_tensors`, run first at the same dispatch, serves the other way a module's own tensors go
unloaded: a map that offloads them under their own keys (ZayaModel's top-level parameters) names no module
for accelerate to hook, so such a module gets an offload hook for its direct tensors.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import itertools
import sys
import textwrap
import types
from typing import Any, Dict, List, Optional, Tuple

from metapatch._offload.hook_state import holds, offload_hooks
from metapatch._offload.offloaded_weights import materialised
from metapatch._offload.store import Overlay
from metapatch._framework.records import MetapatchError

_DEPTH = 3
_ATTR = "_metapatch_outside_reads"
_ENTRY_ATTR = "_metapatch_entry_points"
# Where methods come from that are no model code: their libraries serve offloaded modules themselves (PEFT's layers,
# metapatch's PEFT patches) or read no tensor of a particular model (transformers' base classes, generation).
_LIBRARY_PREFIXES = ("torch.", "accelerate.", "peft.", "bitsandbytes.", "transformers.")
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
        self.stacks.append(_hold(self.owners, self.reads, f"{type(module).__name__} ({self.reader_name or 'the model'})"))

    def post(self, module: Any, args: Any, output: Any) -> None:
        if self.stacks:
            self.stacks.pop().close()


def _hold(owners: List[Any], reads: List[Tuple[str, Any, str]], reader: str) -> contextlib.ExitStack:
    """An open stack holding ``owners`` loaded (close it to offload them again): what a forward reader and an entry
    point run under. A read still on meta then (nothing can load it) raises OffloadedReadError naming ``reader``."""
    stack = contextlib.ExitStack()
    if any(offload_hooks(owner) for owner in owners):
        stack.enter_context(materialised(*owners))
    missing = _unloaded(reads)
    if missing:
        stack.close()
        raise OffloadedReadError(
            f"metapatch: {reader} reads {', '.join(missing)}, which is on the meta device with no accelerate offload "
            f"hook holding its value (read outside its module's forward, or a device map that split a module's "
            f"parameters across devices). Put that whole module on one device in device_map, or load the model "
            f"without offloading it.")
    return stack


def _unloaded(reads: List[Tuple[str, Any, str]]) -> List[str]:
    """The dotted names of ``reads`` (dotted name, owning module, tensor name) still on meta."""
    return [dotted for dotted, owner, tensor in reads
            if getattr(owner._parameters.get(tensor, owner._buffers.get(tensor)), "is_meta", False)]


def _needs_loading(owner: Any) -> bool:
    """Whether a tensor that ``owner``'s offload hooks serve is on meta now: its own (and its submodules' where the
    hook places them). Inside the owner's forward they are loaded, and loading them again would put them back on meta
    when the call ends, under the rest of that forward. Stops at the first on meta."""
    for hook in offload_hooks(owner):
        recurse = bool(getattr(hook, "place_submodules", False))
        if any(t.is_meta for t in itertools.chain(owner.parameters(recurse=recurse), owner.buffers(recurse=recurse))):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _entry_point_names(cls: type) -> Tuple[str, ...]:
    """The public methods of ``cls`` that model code defines (its own or inherited from model code): the
    candidates to be entry points. Not ``forward`` (the hooks serve it), not torch's module API, not what a library
    defines (transformers' base classes and generation read no particular model's tensors; PEFT's layers are
    served by metapatch's PEFT patches)."""
    api = _module_api()
    names = []
    for name in dir(cls):
        if name.startswith("_") or name == "forward" or name in api:
            continue
        function = inspect.getattr_static(cls, name, None)
        if not isinstance(function, types.FunctionType):
            continue  # properties, static and class methods, attributes
        origin = getattr(function, "__module__", None) or ""
        if origin.startswith(_LIBRARY_PREFIXES) and not origin.startswith("transformers.models."):
            continue
        names.append(name)
    return tuple(names)


class _EntryPoints:
    """A module's methods that read offloaded tensors: per method, the modules it keeps loaded while it runs and the
    tensors it reads (checked once they are loaded, as a reader's)."""

    def __init__(self, module_name: str, methods: Dict[str, Tuple[List[Any], List[Tuple[str, Any, str]]]]) -> None:
        self.module_name = module_name
        self.methods = methods


@functools.lru_cache(maxsize=None)
def _entry_point(name: str, function: Any) -> Any:
    """The function bound (``types.MethodType``) as the instance attribute ``name`` of a module whose class method
    ``function`` reads offloaded tensors; it finds what to load in the instance's own record, so a deep copy of the
    module, which rebinds it, loads the copy's. ``inspect.signature`` sees ``function``'s (``generate()`` picks the
    arguments of ``get_image_features`` by it)."""

    @functools.wraps(function)
    def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
        record = self.__dict__.get(_ENTRY_ATTR)
        owners, reads = record.methods.get(name, ([], [])) if record is not None else ([], [])
        if not _unloaded(reads) and not any(_needs_loading(owner) for owner in owners):
            return function(self, *args, **kwargs)  # inside a forward (its hooks loaded them), or nothing offloaded
        with _hold(owners, reads, f"{type(self).__name__}.{name}() ({record.module_name or 'the model'})"):
            result = function(self, *args, **kwargs)
            aliased = bool(_storages(result) & _storages(list(itertools.chain.from_iterable(
                itertools.chain(owner.parameters(), owner.buffers()) for owner in owners))))
        if aliased:
            # A getter of held tensors (``return self.newline``, or a view of it): in memory the result is the
            # model's tensor, and a write through it writes the model. What was held goes back on meta now, so that
            # result would take a write and lose it. Called again on the placeholders, as without metapatch's
            # loading: the write is kept by offloaded-placeholder-writes, and reading it raises, as upstream.
            return function(self, *args, **kwargs)
        return result

    return entry


def _storages(value: Any) -> set:
    """The storage addresses of the tensors in ``value`` (a tensor, or a list, tuple or dict of them), meta ones
    left out."""
    torch = sys.modules["torch"]
    if isinstance(value, dict):
        value = list(value.values())
    items = value if isinstance(value, (list, tuple)) else [value]
    return {t.untyped_storage().data_ptr() for t in items
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr()}


def _served(out: Dict[int, Tuple[Any, List[str]]], called: Dict[int, Any], model: Any,
            names: Dict[int, str]) -> Tuple[List[Any], List[Tuple[str, Any, str]]]:
    """From what a method reads (``out``) and whose methods it calls (``called``): the modules whose hooks must hold
    them loaded, and the reads of tensors on meta (those on a device already work without help)."""
    owners: List[Any] = []
    reads: List[Tuple[str, Any, str]] = []
    for owner, tensors in out.values():
        meta = sorted({t for t in tensors if getattr(owner._parameters.get(t, owner._buffers.get(t)), "is_meta", False)})
        if not meta:
            continue
        path = names.get(id(owner), "?")
        reads.extend((f"{path}.{t}" if path else t, owner, t) for t in meta)  # the root's own: no leading dot
        _add_holder(owners, owner, model, names)
    for callee in called.values():  # served when a hook can load them; never refused on a guess
        if any(t is not None and t.is_meta for t in (*callee._parameters.values(), *callee._buffers.values())):
            _add_holder(owners, callee, model, names)
    return owners, reads


def _install_entry_points(name: str, module: Any, model: Any, names: Dict[int, str]) -> bool:
    """Bind, as instance attributes of ``module``, its methods that read offloaded tensors outside any forward
    (replacing an earlier install's); True where there is one."""
    old = module.__dict__.pop(_ENTRY_ATTR, None)
    if old is not None:
        for method in old.methods:
            module.__dict__.pop(method, None)
    methods = {}
    for method in _entry_point_names(type(module)):
        if method in module.__dict__:
            continue  # an instance attribute of the model's own: left as it is
        out: Dict[int, Tuple[Any, List[str]]] = {}
        called: Dict[int, Any] = {}
        _reads(None, module, method, 0, set(), out, called)  # no reader: the module's own tensors count too
        owners, reads = _served(out, called, model, names)
        if owners or reads:
            methods[method] = (owners, reads)
    if not methods:
        return False
    module.__dict__[_ENTRY_ATTR] = _EntryPoints(name, methods)
    for method in methods:
        module.__dict__[method] = types.MethodType(_entry_point(method, inspect.getattr_static(type(module), method)),
                                                   module)
    return True


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
    serve those reads, and bind its methods that read them as entry points; returns the readers' names. Idempotent (a re-dispatch replaces earlier hooks).
    ``modules``: ``model.named_modules()`` as a list, when the caller has walked it already."""
    modules = list(model.named_modules()) if modules is None else modules
    names = {id(module): name for name, module in modules}
    readers = []
    for name, module in modules:
        old = module.__dict__.pop(_ATTR, None)
        if old is not None:
            for handle in old.handles:
                handle.remove()
        _install_entry_points(name, module, model, names)
        out: Dict[int, Tuple[Any, List[str]]] = {}
        called: Dict[int, Any] = {}
        _reads(module, module, "forward", 0, set(), out, called)
        owners, reads = _served(out, called, model, names)
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
