"""metapatch.diagnose on real tiny models: each finding appears where its problem is, names the right
tensors/modules and the patch or action, and stays quiet on a healthy model."""

from __future__ import annotations

import contextlib
import importlib
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import metapatch  # noqa: E402
from metapatch.diagnose import Report, diagnose  # noqa: E402
from metapatch.selftest._models import input_ids, save_tiny_llama  # noqa: E402

OFFLOAD_MAP = {
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
    "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("diagnose")
    return {"plain": save_tiny_llama(root / "plain"), "tied": save_tiny_llama(root / "tied", tie_word_embeddings=True)}


def _load(path, **kwargs):
    return transformers.LlamaForCausalLM.from_pretrained(path, **kwargs).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids()).logits


def test_healthy_in_memory_model(checkpoints):
    report = diagnose(_load(checkpoints["plain"]))
    assert isinstance(report, Report) and report.ok and report.findings == []
    assert report.devices == {"cpu": sum(1 for _ in _load(checkpoints["plain"]).parameters())}
    assert "no problems found" in str(report)


def test_offloaded_model_is_info_only(checkpoints, tmp_path):
    model = _load(checkpoints["plain"], device_map=OFFLOAD_MAP, offload_folder=str(tmp_path / "off"))
    report = diagnose(model)
    assert report.codes() == ["offloaded"] and report.ok and report.has_hf_device_map
    offloaded = report.finding("offloaded")
    assert offloaded.items == ["model.layers.2 (disk)", "model.layers.3 (disk)"]
    assert offloaded.patch == "offloaded-move-guard"
    assert offloaded.patch_state == {r["id"]: r["state"] for r in metapatch.status()}["offloaded-move-guard"]
    meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
    assert report.devices["meta"] == len(meta) and all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in meta)
    data = json.loads(report.to_json())
    assert data["ok"] is True and data["findings"][0]["code"] == "offloaded"


def _checkpoint_without(source, dest, missing):
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            tensors = {k: v for k, v in load_file(item).items() if k not in missing}
            save_file(tensors, dest / item.name, metadata={"format": "pt"})
        else:
            (dest / item.name).write_bytes(item.read_bytes())
    return dest


def test_meta_left_unfilled_and_no_device_map(checkpoints, tmp_path):
    # The seed-000 shape: weights built on meta, the checkpoint lacks some, nothing dispatched.
    source = _checkpoint_without(checkpoints["plain"], tmp_path / "partial", {"lm_head.weight"})
    config = transformers.AutoConfig.from_pretrained(source)
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    from safetensors.torch import load_file

    model.load_state_dict(load_file(source / "model.safetensors"), strict=False, assign=True)
    report = diagnose(model)
    unfilled = report.finding("meta-unfilled")
    assert unfilled is not None and unfilled.severity == "error"
    assert unfilled.items == [n for n, p in model.named_parameters() if p.is_meta] == ["lm_head.weight"]
    assert report.finding("no-hf-device-map") is not None and not report.ok
    assert "lm_head.weight" in str(report)


def test_offload_hook_with_incomplete_weights_map_is_unfilled(checkpoints):
    # A meta tensor under an offload hook whose store lacks it would fail at the next forward.
    model = _load(checkpoints["plain"])
    layer = model.model.layers[1]
    weights = {n: t.detach().clone() for n, t in layer.state_dict().items() if n != "mlp.up_proj.weight"}
    accelerate.hooks.attach_align_device_hook(layer, execution_device="cpu", offload=True, weights_map=weights)
    report = diagnose(model)
    assert report.finding("meta-unfilled").items == ["model.layers.1.mlp.up_proj.weight"]
    assert "model.layers.1.self_attn" in " ".join(report.finding("offloaded").items)


@contextlib.contextmanager
def _without(*patch_ids):
    """The upstream behaviour for a moment: these patches removed, then applied again."""
    for patch_id in patch_ids:
        metapatch.unpatch(patch_id)
    try:
        yield
    finally:
        metapatch.install()


def test_split_without_hf_device_map_and_meta_model_device(checkpoints):
    model = _load(checkpoints["plain"])
    accelerate.cpu_offload(model, execution_device="cpu")  # offloads everything, sets no hf_device_map
    # With offloaded-model-device active, model.device is the execution device: nothing to report.
    assert str(model.device) == "cpu"
    assert "model-device-meta" not in diagnose(model).codes()
    with _without("offloaded-model-device", "offloaded-model-device-v4"):
        assert str(model.device) == "meta"
        report = diagnose(model)
    assert {"no-hf-device-map", "model-device-meta", "offloaded"} <= set(report.codes())
    assert "meta-unfilled" not in report.codes()
    assert "inputs.to('cpu')" in report.finding("model-device-meta").fix
    assert report.finding("model-device-meta").patch.startswith("offloaded-model-device")
    # every module with parameters; rotary_emb holds only a buffer, which cpu_offload leaves in place
    assert report.finding("offloaded").items == [
        "model.embed_tokens (cpu)", "model.layers (cpu)", "model.norm (cpu)", "lm_head (cpu)"]


def test_model_device_meta_from_device_map(checkpoints, tmp_path):
    device_map = dict(OFFLOAD_MAP, **{"model.embed_tokens": "disk"})
    model = _load(checkpoints["plain"], device_map=device_map, offload_folder=str(tmp_path / "off"))
    assert str(model.device) == "cpu"  # offloaded-model-device
    with _without("offloaded-model-device", "offloaded-model-device-v4"):
        assert str(model.device) == "meta"
        report = diagnose(model)
    finding = report.finding("model-device-meta")
    assert finding is not None and "inputs.to('cpu')" in finding.fix
    # the advice works: inputs on that device run the model
    assert _logits(model).shape[-1] == model.config.vocab_size


def test_tied_group_split(checkpoints, tmp_path):
    model = _load(checkpoints["tied"], device_map={"model": "cpu", "lm_head": "cpu"})
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "tied-split" not in diagnose(model).codes()
    # The map an upstream without the tie repair produces (seed 000): the copies on different devices.
    model.hf_device_map = {"model": "cpu", "lm_head": "disk"}
    finding = diagnose(model).finding("tied-split")
    assert finding is not None and finding.items == ["model.embed_tokens.weight (cpu) + lm_head.weight (disk)"]
    assert finding.patch and finding.patch.startswith("tied-device-map")


def test_hooks_without_skip_keys(checkpoints):
    model = _load(checkpoints["plain"], device_map={"": "cpu"})
    assert "skip-keys-missing" not in diagnose(model).codes()
    # What a re-dispatch without skip_keys leaves (PEFT's load_adapter does one).
    hook = accelerate.hooks.AlignDevicesHook(execution_device="cpu", io_same_device=True)
    accelerate.hooks.add_hook_to_module(model, hook)
    declared = model._skip_keys_device_placement  # "past_key_values" up to 5.11, "cache" in later releases
    declared = sorted([declared] if isinstance(declared, str) else declared)
    finding = diagnose(model).finding("skip-keys-missing")
    assert finding is not None and finding.items == [f"(model) lacks {', '.join(declared)}"]
    assert finding.patch == "accelerate-dispatch-skip-keys"


def test_quant_state_on_meta():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, compress_statistics=True, quant_type="nf4"))
    model[0].weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, compress_statistics=True,
                                        quant_type="nf4")
    model.to("cpu")  # quantizes
    state = model[0].weight.quant_state
    assert state is not None and state.nested
    assert "quant-state-meta" not in diagnose(model).codes()
    state.offset = state.offset.to("meta")  # what a dispatch that skipped the nested state leaves behind
    finding = diagnose(model).finding("quant-state-meta")
    assert finding is not None and finding.items == ["0.weight.quant_state: offset"]
    assert finding.patch == "bnb-quant-state-offload"


def test_peft_model_over_offloaded_base(checkpoints, tmp_path):
    peft = pytest.importorskip("peft")
    base = _load(checkpoints["plain"], device_map=OFFLOAD_MAP, offload_folder=str(tmp_path / "off"))
    config = peft.LoraConfig(r=2, target_modules=r".*layers\.0\.self_attn\.q_proj", init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    report = diagnose(model)
    assert report.has_hf_device_map and report.codes() == ["offloaded"]
    assert report.finding("offloaded").items == ["base_model.model.model.layers.2 (disk)",
                                                 "base_model.model.model.layers.3 (disk)"]


def test_diagnose_does_not_change_the_model(checkpoints, tmp_path):
    model = _load(checkpoints["plain"], device_map=OFFLOAD_MAP, offload_folder=str(tmp_path / "off"))
    before = {n: (t.device, t.dtype) for n, t in model.state_dict(keep_vars=True).items()}
    reference = _logits(model)
    diagnose(model)
    assert {n: (t.device, t.dtype) for n, t in model.state_dict(keep_vars=True).items()} == before
    assert torch.equal(_logits(model), reference)


def test_metapatch_diagnose_stays_callable_once_its_module_is_imported():
    # The first call imports metapatch.diagnose, which then is the package's attribute: a second call,
    # or one after `from metapatch.diagnose import Report`, used to raise "'module' object is not callable".
    import subprocess
    import sys

    code = ("import metapatch, torch\n"
            "model = torch.nn.Linear(2, 2)\n"
            "first = metapatch.diagnose(model)\n"
            "from metapatch.diagnose import Report\n"
            "second = metapatch.diagnose(model)\n"
            "print(type(first).__name__, isinstance(second, Report), second.ok)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Report", "True", "True"]


def test_rejects_what_is_not_a_model():
    with pytest.raises(metapatch.MetapatchError, match="torch.nn.Module"):
        diagnose({"model.layers.0": "cpu"})


def test_findings_name_their_patch_through_the_records():
    # diagnose names no patch id itself: a record lists the finding codes it fixes (Patch.diagnoses).
    import inspect

    from metapatch.diagnose import report as _diagnosis_report
    from metapatch._framework.registry import load_patches

    records = load_patches()
    declared = {code for patch in records for code in patch.diagnoses}
    assert declared <= set(_diagnosis_report.CODES)
    # meta-unfilled names the tied-split fixer, and only when the unfilled tensors are tied
    assert declared == set(_diagnosis_report.CODES) - {"meta-unfilled"}
    source = inspect.getsource(importlib.import_module("metapatch.diagnose"))
    assert not [p.id for p in records if f'"{p.id}"' in source]
