"""The offload store (metapatch/_offload_store.py): what PEFT writes into an offloaded base layer while
metapatch holds it onloaded is kept for the hook to serve, or refused; and the PEFT / load-adapter
wrappers leave a model with nothing offloaded to upstream, call for call.

Regression tests of the offload store's findings, on real offloaded models (tiny Llama and GPT-2 for Conv1D, layers
on disk through ``offload_folder``, non-zero adapters), each compared with the in-memory model:

1. ``get_peft_model`` with PiSSA/OLoRA (their residual ``W - s·B·A`` written into the base weight);
2. a saved PiSSA adapter loaded by ``PeftModel.from_pretrained`` and transformers' ``model.load_adapter``
   (peft re-runs the initialisation);
3. an adapter saved with its embedding layer, loaded over a base whose ``embed_tokens`` is on disk, and
   ``modules_to_save`` over a head on disk;
5. peft's ``low_cpu_mem_usage`` injection with trainable tokens on a model with nothing offloaded.

Measured without the store (metapatch on, transformers 5.24.0, peft 0.21.2, accelerate 1.15.0): logits off by
0.17 (Llama PiSSA), 0.28 (Llama OLoRA), 0.044 (GPT-2 PiSSA), 0.27 (saved embedding on disk), gradients by
0.04-0.15; upstream (METAPATCH_DISABLE=all) raises ``Attempted to call variable.set_data(tensor)``.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

import metapatch  # noqa: E402
from metapatch import MetapatchError, registry  # noqa: E402
from metapatch.patches.peft_offload_redispatch import PATCH as REDISPATCH  # noqa: E402
from metapatch.patches.transformers_load_adapter_offload import PATCH as LOAD_ADAPTER  # noqa: E402
from metapatch.selftest._models import input_ids, save_tiny_llama  # noqa: E402

if not (registry.gate(REDISPATCH).affected and registry.gate(LOAD_ADAPTER).affected):
    pytest.skip("the PEFT patches are not active on this install", allow_module_level=True)

LLAMA_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
             "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
GPT2_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "cpu", "transformer.h.1": "disk",
            "transformer.ln_f": "cpu", "lm_head": "cpu"}
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
X = None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("store-checkpoints")
    llama = save_tiny_llama(root / "llama")
    torch.manual_seed(0)
    # no dropout: one backward is compared with the in-memory model's
    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(root / "gpt2")
    return {"llama": (llama, LLAMA_MAP), "gpt2": (root / "gpt2", GPT2_MAP)}


def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


class Offloaded:
    """An in-memory reference and an offloaded copy of one checkpoint; checks at the end that neither the
    checkpoint nor the offload folder was written, and that the working directory stayed empty."""

    def __init__(self, path: Path, device_map: dict, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.path, self.folder = path, folder
        self.reference = AutoModelForCausalLM.from_pretrained(path).eval()
        self.offloaded = AutoModelForCausalLM.from_pretrained(path, device_map=device_map,
                                                              offload_folder=str(folder)).eval()
        assert any(p.is_meta for p in self.offloaded.parameters())  # really offloaded
        self.before = (_hashes(path), _hashes(folder))

    def unchanged(self) -> None:
        assert (_hashes(self.path), _hashes(self.folder)) == self.before


@pytest.fixture
def offloaded(checkpoints, tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    made = []

    def make(arch: str, device_map: dict = None) -> Offloaded:
        path, default_map = checkpoints[arch]
        made.append(Offloaded(path, device_map or default_map, tmp_path / f"offload{len(made)}"))
        return made[-1]

    yield make
    for pair in made:
        pair.unchanged()
    assert list(work.iterdir()) == []


def _logits(model) -> "torch.Tensor":
    with torch.no_grad():
        return model(input_ids()).logits


def _gradients(model) -> dict:
    model.train()
    ids = input_ids()
    model(ids, labels=ids).loss.backward()
    model.eval()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_same(reference, offloaded, gradients: bool = False) -> None:
    assert torch.equal(_logits(reference), _logits(offloaded))
    if gradients:
        expected, got = _gradients(reference), _gradients(offloaded)
        assert expected and set(expected) == set(got)
        for name in expected:
            assert torch.equal(expected[name], got[name]), name


# -- 1. PiSSA/OLoRA write the residual into the offloaded base weight -----------------------------------


@pytest.mark.parametrize("arch,init", [("llama", "pissa"), ("llama", "pissa_niter_2"), ("llama", "olora"),
                                       ("gpt2", "pissa")])
def test_get_peft_model_keeps_the_residual_written_into_the_offloaded_base(offloaded, arch, init):
    from peft import LoraConfig, get_peft_model

    pair = offloaded(arch)
    config = LoraConfig(r=4, target_modules=TARGETS[arch], init_lora_weights=init)
    if init == "pissa_niter_2":
        torch.manual_seed(0)  # the randomized SVD draws: the same draws on both sides
    reference = get_peft_model(pair.reference, copy.deepcopy(config))
    if init == "pissa_niter_2":
        torch.manual_seed(0)
    model = get_peft_model(pair.offloaded, copy.deepcopy(config))
    assert_same(reference, model, gradients=True)


# -- 2. a saved PiSSA adapter: peft re-runs the initialisation when loading it --------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("entry", ["PeftModel.from_pretrained", "model.load_adapter"])
def test_loading_a_saved_pissa_adapter_keeps_the_residual(offloaded, tmp_path, arch, entry):
    from peft import LoraConfig, PeftModel, get_peft_model

    source = offloaded(arch)
    get_peft_model(source.reference, LoraConfig(r=4, target_modules=TARGETS[arch], init_lora_weights="pissa")) \
        .save_pretrained(tmp_path / "adapter")
    pair = offloaded(arch)
    if entry == "PeftModel.from_pretrained":
        reference = PeftModel.from_pretrained(pair.reference, tmp_path / "adapter", is_trainable=True)
        model = PeftModel.from_pretrained(pair.offloaded, tmp_path / "adapter", is_trainable=True)
    else:
        reference, model = pair.reference, pair.offloaded
        reference.load_adapter(str(tmp_path / "adapter"))
        model.load_adapter(str(tmp_path / "adapter"))
    assert_same(reference, model, gradients=entry == "PeftModel.from_pretrained")


# -- 3. tensors a load brings for an offloaded module -------------------------------------------------


@pytest.mark.parametrize("entry", ["PeftModel.from_pretrained", "model.load_adapter"])
def test_a_saved_embedding_layer_is_served_for_an_embedding_on_disk(offloaded, tmp_path, entry):
    from peft import LoraConfig, get_peft_model

    source = offloaded("llama")
    trained = get_peft_model(source.reference, LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"],
                                                          init_lora_weights=False))
    with torch.no_grad():  # the saved embedding differs from the base's
        trained.base_model.model.model.embed_tokens.base_layer.weight.mul_(-1.5)
    trained.save_pretrained(tmp_path / "adapter", save_embedding_layers=True)
    pair = offloaded("llama", dict(LLAMA_MAP, **{"model.embed_tokens": "disk"}))
    reference, model = _load_both(pair, tmp_path / "adapter", entry)
    assert not torch.equal(_logits(reference), _logits(source.offloaded))  # the saved embedding matters
    assert_same(reference, model)


@pytest.mark.parametrize("entry", ["PeftModel.from_pretrained", "model.load_adapter"])
def test_modules_to_save_of_a_head_on_disk(offloaded, tmp_path, entry):
    from peft import LoraConfig, get_peft_model

    source = offloaded("llama")
    trained = get_peft_model(source.reference, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                                          init_lora_weights=False))
    with torch.no_grad():
        trained.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    trained.save_pretrained(tmp_path / "adapter")
    pair = offloaded("llama", dict(LLAMA_MAP, lm_head="disk"))
    reference, model = _load_both(pair, tmp_path / "adapter", entry)
    assert_same(reference, model)


def test_merge_and_unload_keeps_the_merged_weight(offloaded):
    from peft import LoraConfig, get_peft_model

    pair = offloaded("llama")
    config = LoraConfig(r=4, target_modules=TARGETS["llama"], init_lora_weights=False)
    torch.manual_seed(0)
    reference = get_peft_model(pair.reference, copy.deepcopy(config)).merge_and_unload()
    torch.manual_seed(0)
    model = get_peft_model(pair.offloaded, copy.deepcopy(config)).merge_and_unload()
    assert_same(reference, model)


# -- 4. saving: the base tensors peft saves beside the adapter are read from where the hook serves them ----

_SAVES = {  # what peft saves of the base: embedding layers (targets), biases (bias="all"); all on disk here
    "llama-embeddings": ("llama", dict(LLAMA_MAP, **{"model.embed_tokens": "disk", "lm_head": "disk"}),
                         {"target_modules": ["q_proj", "embed_tokens", "lm_head"]}),
    "gpt2-biases": ("gpt2", GPT2_MAP, {"target_modules": ["c_attn"], "bias": "all"}),
}


def _saved(model, folder: Path) -> dict:
    from safetensors.torch import load_file

    model.save_pretrained(folder)
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("case", sorted(_SAVES))
def test_saving_an_adapter_reads_offloaded_base_tensors_from_the_hook(offloaded, tmp_path, case):
    """Before: ``NotImplementedError: Cannot copy out of meta tensor`` (peft copies the meta placeholders
    of the offloaded base tensors it saves); unpatched the head case saves NaN. Now the saved file equals
    the in-memory model's tensor by tensor, and so does the reloaded model."""
    from peft import LoraConfig, PeftModel, get_peft_model

    arch, device_map, options = _SAVES[case]
    pair = offloaded(arch, device_map)
    offloaded_names = {name for name, p in pair.offloaded.named_parameters() if p.is_meta}
    models = []
    for base in (pair.reference, pair.offloaded):
        torch.manual_seed(0)
        models.append(get_peft_model(base, LoraConfig(r=4, init_lora_weights=False, **options)))
    expected, got = _saved(models[0], tmp_path / "reference"), _saved(models[1], tmp_path / "offloaded")
    assert expected.keys() == got.keys()
    assert any(key.replace("base_model.model.", "", 1).replace(".base_layer", "") in offloaded_names
               for key in got), sorted(got)  # what is saved includes offloaded base tensors
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    fresh = offloaded(arch, device_map)
    assert_same(PeftModel.from_pretrained(fresh.reference, tmp_path / "reference"),
                PeftModel.from_pretrained(fresh.offloaded, tmp_path / "offloaded"))


# -- what cannot be kept is refused ---------------------------------------------------------------------


def _disk_layer(offloaded):
    pair = offloaded("llama")
    return pair.offloaded.model.layers[1].self_attn.q_proj


def test_a_write_into_a_stand_in_is_refused_naming_the_tensor(offloaded):
    from metapatch._offload.adapter_offload import base_layer_stood_in

    layer = _disk_layer(offloaded)
    with pytest.raises(MetapatchError, match=r"Linear\.weight"):
        with base_layer_stood_in(layer):
            with torch.no_grad():
                layer.weight.fill_(1.0)
    assert layer.weight.is_meta  # the placeholder is back


def test_a_changed_tensor_of_another_class_is_refused_naming_it(offloaded):
    from metapatch._offload.adapter_offload import base_layer_onloaded

    class Quantized(torch.nn.Parameter):
        pass

    layer = _disk_layer(offloaded)
    with pytest.raises(MetapatchError, match=r"Linear\.weight \(a Quantized\)"):
        with base_layer_onloaded(layer):
            layer._parameters["weight"] = Quantized(layer.weight.detach() * 2, requires_grad=False)


def test_writes_through_data_in_place_are_kept(offloaded):
    from metapatch._offload.adapter_offload import base_layer_onloaded

    layer = _disk_layer(offloaded)
    x = torch.randn(2, layer.in_features)
    expected = torch.nn.functional.linear(x, layer._hf_hook.weights_map["weight"] * 3)
    with base_layer_onloaded(layer):
        layer.weight.data.mul_(3)  # .data: no _version bump, found by value
    assert layer.weight.is_meta
    with torch.no_grad():
        assert torch.equal(layer(x), expected)


# -- 5. nothing offloaded: upstream, untouched ----------------------------------------------------------

_UPSTREAM = tuple(f"{__import__(name).__path__[0]}/" for name in ("peft", "transformers", "accelerate"))


class _Calls:
    """Every call into peft, transformers or accelerate code (function, file, line), in order."""

    def __init__(self) -> None:
        self.calls = []

    def __enter__(self):
        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(_UPSTREAM):
                self.calls.append((frame.f_code.co_qualname, frame.f_code.co_filename, frame.f_code.co_firstlineno))

        gc.disable()  # a finaliser run by a collection mid-flow would be a call of its own
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        gc.enable()


def _without_peft_patches(function):
    ids = (REDISPATCH.id, LOAD_ADAPTER.id)
    for patch_id in ids:
        metapatch.unpatch(patch_id)
    try:
        return function()
    finally:
        metapatch.install(ids)
        states = {row["id"]: row["state"] for row in metapatch.status()}
        assert all(states[patch_id] == "applied" for patch_id in ids), states


def _same_with_and_without(flow):
    """``flow()`` (fresh objects each time) gives the same result and makes the same upstream calls
    with the PEFT patches as without them."""
    flow()  # warm up: lazy imports and caches of the first call are not a difference
    with _Calls() as patched:
        got = flow()
    with _Calls() as unpatched:
        expected = _without_peft_patches(flow)
    assert patched.calls and patched.calls == unpatched.calls
    return got, expected


def _flows(path: Path, adapter: Path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(path).eval()

    def lora():
        torch.manual_seed(0)
        return _logits(get_peft_model(base(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)))

    def trainable_tokens_low_cpu_mem_usage():
        from peft import inject_adapter_in_model

        torch.manual_seed(0)
        config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [0, 3]})
        model = inject_adapter_in_model(config, base(), low_cpu_mem_usage=True)
        return sorted((name, str(p.device)) for name, p in model.named_parameters())

    def from_pretrained():
        return _logits(PeftModel.from_pretrained(base(), adapter))

    def load_adapter():
        model = base()
        model.load_adapter(str(adapter))
        return _logits(model)

    def merge():
        return _logits(PeftModel.from_pretrained(base(), adapter).merge_and_unload())

    def save_embedding_layers():
        from peft import get_peft_model_state_dict

        torch.manual_seed(0)
        model = get_peft_model(base(), LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
        return sorted((key, tuple(value.shape)) for key, value in get_peft_model_state_dict(model).items())

    return {"get_peft_model": lora, "trainable_tokens_low_cpu_mem_usage": trainable_tokens_low_cpu_mem_usage,
            "PeftModel.from_pretrained": from_pretrained, "model.load_adapter": load_adapter,
            "merge_and_unload": merge, "save_embedding_layers": save_embedding_layers}


@pytest.fixture(scope="module")
def saved_adapter(checkpoints, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("store-adapter") / "adapter"
    torch.manual_seed(0)
    get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoints["llama"][0]),
                   LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("flow", ["get_peft_model", "trainable_tokens_low_cpu_mem_usage", "PeftModel.from_pretrained",
                                  "model.load_adapter", "merge_and_unload", "save_embedding_layers"])
def test_nothing_offloaded_is_left_to_upstream_call_for_call(checkpoints, saved_adapter, flow):
    got, expected = _same_with_and_without(_flows(checkpoints["llama"][0], saved_adapter)[flow])
    if isinstance(got, torch.Tensor):
        assert torch.equal(got, expected)
    else:
        assert got == expected


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_a_model_on_meta_under_init_empty_weights_is_left_to_upstream(low_cpu_mem_usage):
    from accelerate import init_empty_weights
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import tiny_llama_config

    def flow():
        with init_empty_weights():
            model = LlamaForCausalLM(tiny_llama_config())
        config = LoraConfig(r=4, target_modules=["q_proj"],
                            trainable_token_indices={"embed_tokens": [1]} if low_cpu_mem_usage else None)
        model = inject_adapter_in_model(config, model, low_cpu_mem_usage=low_cpu_mem_usage)
        return sorted((name, str(p.device), tuple(p.shape)) for name, p in model.named_parameters())

    got, expected = _same_with_and_without(flow)
    assert got == expected


def _load_both(pair, adapter, entry):
    """The saved adapter loaded by ``entry`` over the in-memory and the offloaded base."""
    from peft import PeftModel

    if entry == "PeftModel.from_pretrained":
        return PeftModel.from_pretrained(pair.reference, adapter), PeftModel.from_pretrained(pair.offloaded, adapter)
    pair.reference.load_adapter(str(adapter))
    pair.offloaded.load_adapter(str(adapter))
    return pair.reference, pair.offloaded
