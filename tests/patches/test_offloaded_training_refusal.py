"""offloaded-training-refusal: three-way proof on real offloaded models (subprocesses: a plain AdamW loop and
transformers' Trainer.train(); unpatched the offloaded weights stay untrained, silently; patched and with the
accelerate diff alone the step is refused), then in-process checks (metapatch active) of what is refused and what
trains as before: gradient accumulation, an optimizer built after a forward, frozen offloaded weights, PEFT LoRA
over an offloaded base step by step against the in-memory PEFT model, optimizers built on meta before to_empty().

The in-process maps name ``cpu`` and ``disk`` only, so every model computes on the CPU whatever the machine has
(the scenarios run on the execution device)."""

from __future__ import annotations

import pytest

import metapatch
from metapatch import MetapatchError
from metapatch.patches import offloaded_training_refusal as patch_module
from metapatch.patches.offloaded_training_refusal import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"adamw-step", "trainer-train"}}

    def check_patched(self, scenario, outcome):
        if AFFECTED:
            assert outcome.metrics["refused"] == "OffloadedTrainingError", outcome.metrics

    def check_diff(self, scenario, outcome):
        assert outcome.metrics["refused"] == "RuntimeError", outcome.metrics  # accelerate's own refusal


# -- in process --------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
in_range = pytest.mark.skipif(not AFFECTED, reason=f"{PATCH.id} not in range here: {WHY}")

DISK_HEAD = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk",
             "model.layers.0": "cpu", "model.layers.1": "cpu", "model.layers.2": "cpu", "model.layers.3": "disk"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from metapatch.selftest._models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("training-refusal") / "base")


def _load(checkpoint, folder=None):
    from transformers import LlamaForCausalLM

    if folder is None:
        return LlamaForCausalLM.from_pretrained(checkpoint)
    return LlamaForCausalLM.from_pretrained(checkpoint, device_map=DISK_HEAD, offload_folder=str(folder))


def _loss(model):
    from metapatch.selftest._models import input_ids

    ids = input_ids()
    model.train()
    return model(input_ids=ids, labels=ids).loss


def _logits(model):
    from metapatch.selftest._models import input_ids

    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids()).logits


@in_range
def test_gradient_accumulation_is_refused_at_the_first_step_by_name(checkpoint, tmp_path):
    model = _load(checkpoint, tmp_path / "offload")
    before = _logits(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        (_loss(model) / 3).backward()
    with pytest.raises(MetapatchError, match=r"AdamW\.step\(\) over 10 trainable parameter") as refused:
        optimizer.step()
    text = str(refused.value)
    assert "model.layers.3.self_attn.q_proj.weight" in text and "and 2 more" in text  # 9 of layer 3, lm_head
    assert "requires_grad_(False)" in text
    assert "PEFT" in text and "device_map" in text
    assert torch.equal(_logits(model), before)  # nothing was updated, in memory or offloaded
    with pytest.raises(MetapatchError):  # still refused: never a silent second try
        optimizer.step()


@in_range
def test_an_optimizer_built_after_a_forward_is_refused_by_name(checkpoint, tmp_path):
    """The hooks put a new placeholder in place after every forward: at the step, the optimizer's placeholders are
    not the module's any more; they were noted when the optimizer took them."""
    model = _load(checkpoint, tmp_path / "offload")
    _logits(model)  # e.g. an evaluation before training
    optimizer = torch.optim.SGD([model.lm_head.weight, *model.model.layers[0].parameters()], lr=0.1)
    taken = model.lm_head.weight
    _loss(model).backward()
    assert model.lm_head.weight is not taken and taken.grad is None  # the case under test
    with pytest.raises(MetapatchError, match=r"SGD\.step\(\) over 1 trainable parameter.*: lm_head\.weight\."):
        optimizer.step()


@in_range
def test_a_head_resized_over_the_offload_is_refused_by_name(checkpoint, tmp_path):
    """resize_token_embeddings builds a new head and hangs the old head's offload hook on it (transformers does it
    without add_hook_to_module's recorder seeing it): the new head's placeholder is still found, and the step refused
    (the flow tester found it silently untrained)."""
    model = _load(checkpoint, tmp_path / "offload")
    model.resize_token_embeddings(132, mean_resizing=False)
    assert model.lm_head.weight.is_meta and model.lm_head.weight.requires_grad
    optimizer = torch.optim.SGD([model.lm_head.weight, *model.model.layers[0].parameters()], lr=0.1)
    _loss(model).backward()
    with pytest.raises(MetapatchError, match=r"SGD\.step\(\) over 1 trainable parameter.*: lm_head\.weight\."):
        optimizer.step()


@in_range
def test_a_trainable_tensor_put_in_place_of_an_offloaded_one_is_refused(checkpoint, tmp_path):
    """``lm_head.weight = nn.Parameter(v)`` on an offloaded head: the offload store serves the new tensor from then on
    (offloaded-placeholder-writes), but each forward loads a copy of it, so the gradient never reaches the program's
    object; in memory it trains. Upstream (and before this check) the step left it untrained, silently."""
    model = _load(checkpoint, tmp_path / "offload")
    for param in model.parameters():
        param.requires_grad_(False)
    head = torch.nn.Parameter(torch.full(tuple(model.lm_head.weight.shape), 0.01))
    model.lm_head.weight = head
    optimizer = torch.optim.SGD([head], lr=0.1)
    _loss(model).backward()
    assert head.grad is None  # the case under test: the gradient went to the loaded copy
    with pytest.raises(MetapatchError, match=r"SGD\.step\(\) over 1 trainable parameter.*Linear\.weight \(a tensor put"):
        optimizer.step()
    assert torch.equal(head, torch.full(tuple(head.shape), 0.01))


def _train_steps(model, params, steps=3):
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    seen = []
    for _ in range(steps):
        _loss(model).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(_logits(model))
    return seen


@in_range
def test_frozen_offloaded_weights_train_the_rest_as_in_memory(checkpoint, tmp_path):
    """Freezing what is offloaded (the advice of the refusal): the same updates as an in-memory model with the same
    parameters frozen, step by step (equal bits)."""
    reference = _load(checkpoint)
    model = _load(checkpoint, tmp_path / "offload")
    frozen = {n for n, p in model.named_parameters() if p.is_meta}
    assert frozen
    for m in (reference, model):
        for name, param in m.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
    want = _train_steps(reference, [p for p in reference.parameters() if p.requires_grad])
    got = _train_steps(model, [p for p in model.parameters() if p.requires_grad])
    assert not torch.equal(want[0], want[-1])  # the steps did train
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {step}: max abs diff {(a - b).abs().max().item():.3g}"


@in_range
def test_peft_lora_over_an_offloaded_base_trains_as_in_memory(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")

    def build(folder):
        torch.manual_seed(5)
        config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
        return peft.get_peft_model(_load(checkpoint, folder), config)

    reference, model = build(None), build(tmp_path / "offload")
    assert any(p.is_meta for p in model.parameters())  # the base is offloaded (and frozen by PEFT)
    want = _train_steps(reference, list(reference.parameters()))
    got = _train_steps(model, list(model.parameters()))
    assert not torch.equal(want[0], want[-1])
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {step}: max abs diff {(a - b).abs().max().item():.3g}"
    trained = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    for name, param in model.named_parameters():
        if name in trained:
            assert torch.equal(param, trained[name]), name


@in_range
def test_nothing_offloaded_steps_exactly_as_without_the_check(checkpoint):
    """The pre-hook returns without touching anything: the same updates with it registered and removed."""
    model_a, model_b = _load(checkpoint), _load(checkpoint)
    got = _train_steps(model_a, list(model_a.parameters()))
    handle = patch_module._State.handle
    assert handle is not None
    handle.remove()
    try:
        want = _train_steps(model_b, list(model_b.parameters()))
    finally:
        patch_module._State.handle = None
        patch_module._register()
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))


@in_range
def test_an_optimizer_built_on_meta_before_to_empty_steps(checkpoint, tmp_path):
    """Built over meta parameters, then to_empty(): not offload placeholders (to_empty gives the modules new
    parameters on torch 2.13, so this optimizer updates nothing, a different mistake, not refused here); and a
    shape-only dry run on meta (meta gradients) is not refused either, while an offloaded model with parameters of
    the same shapes is alive."""
    from transformers import LlamaForCausalLM

    offloaded = _load(checkpoint, tmp_path / "offload")  # alive: placeholders of the same shapes are served
    _logits(offloaded)
    config = _load(checkpoint).config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dry = torch.optim.SGD([torch.nn.Parameter(torch.empty(128, 64, device="meta"))], lr=0.1)
    dry.param_groups[0]["params"][0].grad = torch.empty(128, 64, device="meta")
    dry.step()  # a meta parameter with a (meta) gradient: a dry run, not a placeholder
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    _loss(model).backward()
    optimizer.step()
    assert any(p.is_meta for p in offloaded.parameters())


LATE = r"""
import tempfile, torch
from accelerate import dispatch_model
from accelerate.utils import offload_state_dict
from torch import nn
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
folder = tempfile.mkdtemp()
offload_state_dict(folder, {k: v for k, v in model.state_dict().items() if k.startswith("1.")})
dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, offload_dir=folder)
import metapatch  # after the model was dispatched: its hooks were attached unseen
def step():
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    try:
        optimizer.step()
    except metapatch.MetapatchError as error:
        return "refused: " + str(error).split(". Between")[0]
    return "stepped"
print(step())
metapatch.unpatch("offloaded-training-refusal")
print(step())
metapatch.install()
print(step())
"""


@in_range
def test_imported_after_dispatch_refuses_and_unpatch_turns_it_off(tmp_path):
    """metapatch imported after the model was dispatched (its offload hooks were never recorded): the step is still
    refused by name; after unpatch() it steps as upstream does, and install() brings the refusal back."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "METAPATCH_STRICT"}  # the late import warns
    run = subprocess.run([sys.executable, "-c", LATE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("refused: ") and "1.weight, 1.bias" in lines[0], lines
    assert lines[1] == "stepped", lines
    assert lines[2].startswith("refused: "), lines


OPTIMIZER_BEFORE = r"""
import os, sys, tempfile, torch
from accelerate import dispatch_model
from accelerate.utils import offload_state_dict
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
folder = tempfile.mkdtemp()
offload_state_dict(folder, {k: v for k, v in model.state_dict().items() if k.startswith("1.")})
dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, offload_dir=folder)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # takes the placeholders the hooks serve now
import metapatch  # after both: no add_param_group of the patch saw the placeholders
head = [p.clone() for p in model[0].parameters()]
model(torch.randn(2, 8)).sum().backward()  # the forward puts new placeholders in place: the optimizer keeps the old
try:
    optimizer.step()
    print("stepped", any(not torch.equal(a, b) for a, b in zip(head, model[0].parameters())))
except metapatch.MetapatchError as error:
    print("refused: " + str(error).split(". Between")[0])
"""


@in_range
@pytest.mark.parametrize("patched", [True, False])
def test_an_optimizer_built_before_a_late_import_is_refused(tmp_path, patched):
    """The optimizer was built over a dispatched model before ``import metapatch``: the patch notes its placeholders
    when it applies, so the step after a forward is refused by name; without the patch it steps, training only the
    layer in memory (silently leaving the offloaded one untrained)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH_")}  # the late import warns
    if not patched:
        env["METAPATCH_DISABLE"] = PATCH.id
    run = subprocess.run([sys.executable, "-c", OPTIMIZER_BEFORE], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.strip().splitlines()[-1]
    if patched:
        assert line.startswith("refused: ") and "1.weight, 1.bias" in line, line
    else:
        assert line == "stepped True", line
