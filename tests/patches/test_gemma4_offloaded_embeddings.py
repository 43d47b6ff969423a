"""gemma4-offloaded-embeddings: three-way proof on tiny Gemma 4 models with per-layer inputs and embed_tokens on
disk (subprocesses), plus in-process checks of the shared mechanism (metapatch._offload.offloaded_weights) that
diffusion-gemma-offloaded-embeddings uses too.

Measured unpatched (RuntimeError "Tensor on device meta is not on the expected device cpu!"): transformers
5.11.0, 5.17.0, 5.24.0. Gemma 4 is missing before 5.5: the scenarios report n/a there (4.57.6 here)."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.gemma4_offloaded_embeddings import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


def _has_gemma4() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers.models.gemma4") is not None


HAS_GEMMA4 = _has_gemma4()


def test_gate_follows_the_model():
    # affected exactly where Gemma 4 exists (every release that has it reads the weight directly)
    assert AFFECTED == HAS_GEMMA4, WHY


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"conditional-generation-embedding-on-disk", "causal-lm-inputs-embeds-embedding-on-disk"}}

    def not_applicable_reason(self, scenario):
        return "" if HAS_GEMMA4 else None  # n/a exactly where Gemma 4 is missing

    def own_not_applicable(self, scenario, outcome):
        if outcome.patched:
            assert outcome.states[PATCH.id] == "not-affected", outcome.states

    def patched_states(self, scenario):
        return ("applied", "pending-import")  # the child may not import gemma4 again


# -- in-process: the shared mechanism on a plain module offloaded with accelerate's own hooks ------

torch = pytest.importorskip("torch")
hooks = pytest.importorskip("accelerate.hooks")


class ReadsWeightDirectly(torch.nn.Module):
    """Reads embed.weight outside embed's forward, as Gemma 4 and DiffusionGemma do."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.embed(ids) + self.embed.weight[0]


def _offloaded():
    from metapatch._offload.offloaded_weights import call_with_materialised

    torch.manual_seed(0)
    module = ReadsWeightDirectly().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = module(ids)
    hooks.attach_align_device_hook(module.embed, execution_device="cpu", offload=True)
    return module, ids, expected, call_with_materialised("embed")


def test_materialised_for_the_call_then_offloaded_again():
    import wrapt

    module, ids, expected, wrapper = _offloaded()
    assert module.embed.weight.is_meta
    with pytest.raises(RuntimeError, match="meta"):
        with torch.no_grad():
            module(ids)  # upstream behaviour of such a read
    # installed on the class, as the registry installs wrappers: wrapt then passes the module as instance
    module.__class__ = type("Wrapped", (ReadsWeightDirectly,),
                            {"forward": wrapt.FunctionWrapper(ReadsWeightDirectly.forward, wrapper)})
    with torch.no_grad():
        assert torch.equal(module(ids), expected)
    assert module.embed.weight.is_meta  # offloaded again afterwards
    assert all(h.offload for h in [module.embed._hf_hook])


def test_a_named_upstream_read_holds_no_second_copy(monkeypatch):
    """The methods a patch names (Gemma 4's embedding lookups) only read the weight: no copy of its values is
    taken for the call (that would hold Gemma 4's large offloaded embedding twice); a replacement made during the
    call is still kept, as in memory."""
    import wrapt

    from metapatch._offload import store

    module, ids, expected, wrapper = _offloaded()
    asked = []
    original = store.snapshot
    monkeypatch.setattr(store, "snapshot", lambda *a, **k: asked.append(k.get("values", True)) or original(*a, **k))

    def replaces_weight(self, ids):
        self.embed.weight = torch.nn.Parameter(self.embed.weight * 2)
        return ReadsWeightDirectly.forward(self, ids)

    module.__class__ = type("Wrapped", (ReadsWeightDirectly,),
                            {"forward": wrapt.FunctionWrapper(replaces_weight, wrapper)})
    with torch.no_grad():
        module(ids)
    assert asked == [False]
    assert module.embed.weight.is_meta  # offloaded again; its hook serves the kept replacement from now on
    torch.manual_seed(0)
    in_memory = ReadsWeightDirectly().eval()  # the same weights as _offloaded()'s module
    with torch.no_grad():
        assert torch.equal(module.embed(ids), 2 * in_memory.embed(ids))


def test_offloaded_again_when_the_call_raises():
    import wrapt

    module, _, _, wrapper = _offloaded()

    def failing(self, ids):
        assert not self.embed.weight.is_meta  # materialised inside the call
        raise ValueError("boom")

    module.__class__ = type("Failing", (ReadsWeightDirectly,), {"forward": wrapt.FunctionWrapper(failing, wrapper)})
    with pytest.raises(ValueError, match="boom"):
        module(None)
    assert module.embed.weight.is_meta and module.embed._hf_hook.offload


def test_nested_use_and_modules_without_hooks():
    from metapatch._offload.hook_state import offload_hooks
    from metapatch._offload.offloaded_weights import materialised

    module, ids, expected, _ = _offloaded()
    with materialised(module.embed):
        with materialised(module.embed, None, torch.nn.Linear(2, 2)):  # nested; None and unhooked modules are no-ops
            assert not module.embed.weight.is_meta
        assert not module.embed.weight.is_meta  # the inner block does not offload what the outer one holds
        with torch.no_grad():
            assert torch.equal(module(ids), expected)
    assert module.embed.weight.is_meta
    assert offload_hooks(torch.nn.Linear(2, 2)) == []
