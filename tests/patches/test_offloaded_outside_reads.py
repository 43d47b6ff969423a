"""offloaded-outside-reads: three-way proof on a remote-code-style model whose forward reads offloaded
tensors outside their modules' hooks (subprocesses, real from_pretrained with disk offload), the generic
mechanism standing in for the hand-written Gemma 4 patch, and in-process checks on real accelerate hooks
(disk_offload, dispatch_model): nothing hooked where nothing is offloaded, offloaded again after the
reader (also when it raises), an unservable read named in a MetapatchError."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.offloaded_outside_reads import PATCH
from metapatch.selftest import run_scenario
from metapatch.selftest._harness import find

from _three_way import ThreeWayCase, assert_equals_reference  # tests/patches/_three_way.py

PATCH_ID = PATCH.id
AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


def test_affected_on_every_supported_accelerate():
    assert AFFECTED, WHY


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH_ID,)
    names = {PATCH_ID: {"remote-code-reads-on-disk", "prophetnet-decoder-embeddings-on-disk",
                        "own-parameter-mapped-alone-on-disk", "held-write-through-data-on-disk",
                        "longcat-router-on-disk", "llava-next-image-features-on-disk"}}


EMBEDDING_PATCHES = "gemma4-offloaded-embeddings,diffusion-gemma-offloaded-embeddings"


@pytest.mark.slow  # two runs each, 20-90 s
@pytest.mark.parametrize("key, module", [
    ("gemma4-offloaded-embeddings/conditional-generation-embedding-on-disk", "transformers.models.gemma4"),
    ("gemma4-offloaded-embeddings/causal-lm-inputs-embeds-embedding-on-disk", "transformers.models.gemma4"),
    ("diffusion-gemma-offloaded-embeddings/generate-offloaded-embedding", "transformers.models.diffusion_gemma"),
])
def test_generic_mechanism_replaces_the_hand_written_embedding_patches(key, module):
    """Gemma 4's and DiffusionGemma's direct embed_tokens.weight reads, with both hand-written patches
    disabled: this patch alone passes their scenarios, and fails them when disabled too (so it was this
    patch). Measured on 5.24/1.15, 5.17/1.14, 5.11/1.13 and 5.7/1.13 (where each model exists)."""
    pytest.importorskip(module)
    scenario = find(key)
    outcome = run_scenario(scenario, patched=True, env={"METAPATCH_DISABLE": EMBEDDING_PATCHES})
    assert outcome.states[key.split("/")[0]] == "disabled"
    if key.startswith("gemma4"):
        assert_equals_reference(outcome)
    else:  # the DiffusionGemma scenario checks its own tolerance (compare()) and reports the difference
        assert outcome.passed, outcome.traceback or outcome.stderr_tail
    both = run_scenario(scenario, patched=True, env={"METAPATCH_DISABLE": f"{EMBEDDING_PATCHES},{PATCH_ID}"})
    assert not both.passed, "the scenario passes without any of the three patches: it proves nothing here"


# -- in process, on real accelerate hooks ----------------------------------------------------------

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 4, 4))

    def mix(self, x):
        return torch.einsum("bsh,ehk->bsk", x, self.weight)


class Reader(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.experts = Experts()
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, ids):
        ids = ids.to(self.embed.weight.device)
        x = self.embed(ids) - self.embed.weight[0]
        x = x.to(self.norm.weight.dtype)  # metadata only: needs no loading
        return self.norm(x + self.experts.mix(x))


def _model():
    torch.manual_seed(0)
    model = Reader().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(ids)
    return model, ids, expected


def test_disk_offload_reads_served_and_offloaded_again(tmp_path):
    model, ids, expected = _model()
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    reader = model.__dict__["_metapatch_outside_reads"]
    assert reader.owners == [model.embed, model.experts]  # not norm: only its dtype is read
    with torch.no_grad():
        assert torch.equal(model(ids), expected)
    assert model.embed.weight.is_meta and model.experts.weight.is_meta
    assert model.embed._hf_hook.offload and model.experts._hf_hook.offload


def test_offloaded_again_when_the_reader_raises(tmp_path):
    model, _, _ = _model()
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    with pytest.raises(IndexError):
        with torch.no_grad():
            model(torch.tensor([[99]]))  # out of the embedding's range, after the reads were served
    assert model.embed.weight.is_meta and model.embed._hf_hook.offload


def test_nothing_hooked_where_nothing_is_offloaded():
    model, ids, expected = _model()
    accelerate.dispatch_model(model, device_map={"": "cpu"})
    assert not any("_metapatch_outside_reads" in m.__dict__ for m in model.modules())
    assert not any(m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


def test_a_read_nothing_can_serve_is_a_metapatch_error(tmp_path):
    from accelerate.hooks import remove_hook_from_module

    model, ids, _ = _model()
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    remove_hook_from_module(model.embed)  # detaching loads the weight back...
    model.embed.to("meta")  # ...so put it on meta with nothing left to load it
    with pytest.raises(metapatch.MetapatchError, match=r"Reader \(the model\) reads embed\.weight"):
        with torch.no_grad():
            model(ids)
    assert model.experts.weight.is_meta  # what was loaded before the error is offloaded again


def test_redispatch_replaces_the_hooks(tmp_path):
    model, ids, expected = _model()
    accelerate.disk_offload(model, str(tmp_path / "a"), execution_device="cpu")
    from accelerate.hooks import remove_hook_from_submodules

    remove_hook_from_submodules(model)
    accelerate.disk_offload(model, str(tmp_path / "a"), execution_device="cpu")
    assert len(model._forward_pre_hooks) == 1
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


def test_a_tied_head_beside_an_offloaded_embedding_equals_in_memory(tmp_path):
    """BertLMHeadModel with its embeddings on disk and its tied, biased head on cpu (the sweep's
    first-on-disk): the map repair used to leave cls.predictions.decoder.weight on meta with no hook
    (accelerate hooks modules, not parameters) and the Linear computed on the placeholder (logits ~1e34);
    the repair now moves the head's whole leaf module, and this patch no longer refuses the head's
    parent for the tied bias its forward never reads (tests/patches/test_tied_head_with_bias.py)."""
    transformers = pytest.importorskip("transformers")
    from metapatch.sweep import shrink

    config = shrink.tiny_config(transformers.BertConfig)
    config.is_decoder = True
    torch.manual_seed(0)
    transformers.BertLMHeadModel(config).save_pretrained(tmp_path / "ckpt")
    reference = transformers.BertLMHeadModel.from_pretrained(tmp_path / "ckpt").eval()
    device_map = {"bert.embeddings": "disk", "bert.encoder.layer.0": "cpu", "bert.encoder.layer.1": "cpu", "cls": "cpu"}
    model = transformers.BertLMHeadModel.from_pretrained(tmp_path / "ckpt", device_map=device_map,
                                                         offload_folder=str(tmp_path / "offload")).eval()
    ids = torch.randint(4, 200, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids.to(model.device)).logits, reference(ids).logits)


class Scales(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))


class Writer(torch.nn.Module):
    """A forward that writes a child's parameter it reads: in memory the write persists (the next call
    computes with it); offloaded, the held copy goes back to meta and the write would be lost unless the
    offload store keeps it."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.scales = Scales()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        out = self.proj(x * self.scales.scale)
        if self.how == "in place":
            self.scales.scale.mul_(0.5)
        elif self.how == "replaced":
            self.scales.scale = torch.nn.Parameter(self.scales.scale * 0.5)
        elif self.how == ".data in place":  # bumps no _version of the parameter
            self.scales.scale.data.mul_(0.5)
        elif self.how == ".data replaced":
            self.scales.scale.data = self.scales.scale.data * 0.5
        elif self.how == "element":  # textual-inversion style: one entry through .data
            self.scales.scale.data[1] = 7.0
        return out


_WRITES = ["in place", "replaced", ".data in place", ".data replaced", "element"]
_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("mode", sorted(_MODES))
@pytest.mark.parametrize("how", _WRITES)
@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_a_write_into_a_held_tensor_is_kept_as_in_memory(tmp_path, how, mode, offload):
    """Every way of writing a held tensor (seen by _version or not) reaches the offload store: three calls
    give the in-memory model's outputs (torch.equal), the weight is on meta again, the user's offload
    folder is not written."""
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = Writer(how).eval()
    with _MODES[mode]():
        expected = [reference(x) for _ in range(3)]
    assert not torch.equal(expected[0], expected[1]), "the write changes what the next call computes: it matters"

    torch.manual_seed(0)
    model = Writer(how).eval()
    if offload == "disk":
        accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
        files = {p: p.read_bytes() for p in (tmp_path / "offload").iterdir()}
    else:
        accelerate.cpu_offload(model, execution_device="cpu")
    assert model.__dict__["_metapatch_outside_reads"].owners == [model.scales]
    with _MODES[mode]():
        got = [model(x) for _ in range(3)]
    for call, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), (call, (a - b).abs().max().item())
    assert model.scales.scale.is_meta
    assert model.scales._hf_hook.offload  # offloaded again, as after any forward
    if offload == "disk":
        assert {p: p.read_bytes() for p in (tmp_path / "offload").iterdir()} == files


def test_a_write_into_a_held_tied_tensor_is_refused(tmp_path):
    """A held weight tied to another hook's cannot be kept in step with its partner: refused, not lost."""
    torch.manual_seed(0)
    model = Writer(".data in place").eval()
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    from metapatch._offload.store import TIED_MARK

    model.scales.__dict__[TIED_MARK] = frozenset({"scale"})  # what mark_tied records for a tied weight
    with pytest.raises(metapatch.MetapatchError, match=r"Scales\.scale, a weight tied"):
        with torch.no_grad():
            model(torch.randn(1, 3, 4))
    assert model.scales.scale.is_meta and model.scales._hf_hook.offload


def test_a_reader_that_writes_nothing_runs_under_inference_mode(tmp_path):
    model, ids, expected = _model()
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    with torch.inference_mode():
        assert torch.equal(model(ids), expected)
        assert torch.equal(model(ids), expected)


# -- entry points: a module's methods other than forward, called outside any forward ---------------------------

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


class WithNewline(torch.nn.Module):
    """A parameter of its own read by a public method (LLaVA-NeXT's image_newline in get_image_features)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.newline = torch.nn.Parameter(torch.randn(4))

    def get_features(self, x):
        return torch.cat([self.linear(x), self.newline.expand(x.shape[0], 1, 4).to(x.device)], dim=1)

    def get_newline(self):
        return self.newline

    def scale_newline(self, factor):
        self.newline.data.mul_(factor)
        return self.newline.sum()

    def forward(self, x):
        # the entry point inside the forward, then the forward's own read again: still loaded after it
        return self.get_features(x).sum(dim=1) + self.newline.sum()


def _tiny_blip2():
    transformers = pytest.importorskip("transformers")
    config = transformers.Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8),
        qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            encoder_hidden_size=32, vocab_size=64),
        text_config=dict(model_type="opt", vocab_size=256, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                         num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0),
        num_query_tokens=4, image_token_index=250)
    torch.manual_seed(0)
    return transformers.Blip2ForConditionalGeneration(config).eval()


def _first_tensor(value):
    return value if isinstance(value, torch.Tensor) else _first_tensor(value[0])


@pytest.mark.parametrize("device", DEVICES)
def test_blip2_image_features_and_generate_under_cpu_offload_equal_in_memory(device):
    """BLIP-2's get_image_features (called by the user, and by generate()) reads the model's own query_tokens,
    which its hook loads only inside its forward: upstream "Cannot copy out of meta tensor" for both calls."""
    import copy
    import inspect

    reference = _tiny_blip2().to(device)
    model = copy.deepcopy(reference).cpu()
    accelerate.cpu_offload(model, execution_device=torch.device(device))
    assert model.query_tokens.is_meta
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)
    ids = torch.tensor([[250] * 4 + [1, 5, 6, 7]], device=device)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels)
    with torch.no_grad():
        assert torch.equal(_first_tensor(model.get_image_features(pixel_values=pixels)),
                           _first_tensor(reference.get_image_features(pixel_values=pixels)))
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False),
                           reference.generate(**inputs, max_new_tokens=3, do_sample=False))
    assert model.query_tokens.is_meta  # offloaded again after the call
    # generate() picks get_image_features' arguments by its signature: the bound entry point keeps it
    assert inspect.signature(model.get_image_features) == inspect.signature(reference.get_image_features)


def test_entry_points_only_where_an_offloaded_tensor_is_read(tmp_path):
    model = WithNewline().eval()
    accelerate.dispatch_model(model, device_map={"": "cpu"})
    assert not any("_metapatch_entry_points" in m.__dict__ or "get_features" in m.__dict__ for m in model.modules())
    blip2 = _tiny_blip2()
    accelerate.cpu_offload(blip2, execution_device=torch.device("cpu"))
    bound = {name for name, m in blip2.named_modules() if "_metapatch_entry_points" in m.__dict__}
    assert "" in bound and "get_image_features" in blip2.__dict__["_metapatch_entry_points"].methods
    # a decoder layer's methods read only its own tensors through its forward: nothing bound there
    assert not any(name.startswith("language_model.model.decoder.layers") for name in bound)


@pytest.mark.parametrize("device", DEVICES)
def test_a_method_reading_its_own_offloaded_parameter(tmp_path, device):
    torch.manual_seed(0)
    model = WithNewline().eval()
    x = torch.randn(2, 1, 3)
    with torch.no_grad():
        expected_features, expected = model.get_features(x), model(x)
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device=torch.device(device))
    with torch.no_grad():
        assert torch.equal(model.get_features(x.to(device)).cpu(), expected_features)
        assert torch.equal(model(x.to(device)).cpu(), expected)  # inside forward: called straight through
    assert model.newline.is_meta  # offloaded again after the call


def test_a_method_reading_what_nothing_can_serve_is_a_metapatch_error(tmp_path):
    from accelerate.hooks import remove_hook_from_module

    model = WithNewline().eval()
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    remove_hook_from_module(model)  # detaching loads the parameter back...
    model.newline = torch.nn.Parameter(torch.empty(4, device="meta"))  # ...so put it on meta, nothing to load it
    with pytest.raises(metapatch.MetapatchError, match=r"WithNewline\.get_features\(\) \(the model\) reads newline"):
        with torch.no_grad():
            model.get_features(torch.randn(2, 1, 3))


@pytest.mark.parametrize("getter", ["get_newline", "newline_row"])
def test_a_method_returning_its_offloaded_tensor_returns_what_takes_a_write(tmp_path, getter):
    """A getter of the module's own tensor (or of a view of it): in memory a write through the result writes the
    model. Held loaded for the call, the result would be the loaded copy, put back on meta after it: a write through it
    would vanish. The placeholder is returned instead, as without the binding, and takes the write."""
    torch.manual_seed(0)
    reference = WithNewline().eval()
    model = WithNewline().eval()
    model.load_state_dict(reference.state_dict())
    accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    x = torch.randn(2, 1, 3)
    with torch.no_grad():
        for m in (reference, model):
            if getter == "get_newline":
                m.get_newline()[1] = 5.0
            else:
                m.get_newline()[1:2].fill_(5.0)
        assert torch.equal(model(x), reference(x))


def test_a_write_by_a_bound_method_is_kept_as_in_memory(tmp_path):
    """A method that writes its module's own offloaded parameter outside any forward (through ``.data``): held loaded
    for the call, the write is kept by the offload store, in memory (the offload folder keeps its bytes), and every
    later call sees it, as in memory."""
    import hashlib

    torch.manual_seed(0)
    reference = WithNewline().eval()
    model = WithNewline().eval()
    model.load_state_dict(reference.state_dict())
    folder = tmp_path / "offload"
    accelerate.disk_offload(model, str(folder), execution_device="cpu")
    stored = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}
    x = torch.randn(2, 1, 3)
    with torch.no_grad():
        assert torch.equal(model.scale_newline(3.0), reference.scale_newline(3.0))
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model.get_features(x), reference.get_features(x))
    assert model.newline.is_meta
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()} == stored
