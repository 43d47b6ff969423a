"""Reproducers for ``offloaded-placeholder-writes``: writes into offloaded weights between forwards.

A tiny Llama (untied head) is offloaded two ways: with ``accelerate.cpu_offload`` (what diffusers' sequential
offload calls: every weight a meta placeholder behind accelerate's hooks) and with a real
``from_pretrained(device_map=..., offload_folder=...)`` putting layer 3 and ``lm_head`` on disk. The same writes
go into an in-memory copy, the oracle: textual inversion's ``embedding.weight.data[token] = learned``, and
re-initialising / editing weights in place under ``no_grad`` (``torch.nn.init.zeros_``, ``mul_``, a row assigned,
``.data[:, :4] += 1``). Upstream every write is a no-op on the meta placeholder and the model computes with the
stored values: the logits differ from the in-memory model's, silently, and the scenario fails with that
``AssertionError``. Fixed: equal logits, twice (the written values are served again after the next offload), or
an error at the write that names the offloaded weight. Replacing an offloaded weight with a new tensor
(``replaced-weights``) is the same: upstream the hook loads the stored value over it at the next forward. The reference and the map's memory entries are on the
execution device (``_device``); the writes are deterministic (no random init), so both devices agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict

from . import NotApplicable
from ._device import execution_device, main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, max_abs_diff, save_tiny_llama

PATCH_ID = "offloaded-placeholder-writes"

DEVICE_MAP = {
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
    "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "disk",
}


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(device_input_ids()).logits


def is_refusal(exc: BaseException) -> bool:
    """An error at the write that names the offloaded weight (metapatch's or a fixed release's)."""
    return "offloaded" in str(exc) and "write" in str(exc)


def _compare(workdir: Path, offload: Callable[[Path], Any], write: Callable[[Any], None]) -> Dict[str, Any]:
    from transformers import LlamaForCausalLM

    checkpoint = save_tiny_llama(workdir / "ckpt", tie_word_embeddings=False)
    reference = to_device(LlamaForCausalLM.from_pretrained(checkpoint)).eval()
    untouched = _logits(reference)
    write(reference)
    expected = _logits(reference)
    assert max_abs_diff(expected, untouched) > 0, "the writes changed nothing: the comparison would be vacuous"
    model = offload(checkpoint).eval()
    try:
        write(model)
    except Exception as exc:  # noqa: BLE001 - judged below
        if not is_refusal(exc):
            raise
        return {"max_abs_diff": max_abs_diff(_logits(model), untouched), "refused": type(exc).__name__}
    diffs = [max_abs_diff(_logits(model), expected) for _ in range(2)]
    if max(diffs) != 0:
        raise AssertionError(f"the writes into the offloaded weights were lost: logits differ from the in-memory "
                             f"model's after the same writes by {diffs[0]} (second forward {diffs[1]})")
    return {"max_abs_diff": 0.0, "refused": ""}


def _cpu_offloaded(checkpoint: Path) -> Any:
    import accelerate
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint)
    accelerate.cpu_offload(model, execution_device=main_device())
    assert model.get_input_embeddings().weight.is_meta, "cpu_offload was meant to leave placeholders"
    return model


def _disk_offloaded(checkpoint: Path) -> Any:
    from transformers import LlamaForCausalLM

    device_map = {name: main_device() if device == "cpu" else device for name, device in DEVICE_MAP.items()}
    model = LlamaForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                             offload_folder=str(checkpoint.parent / "offload"))
    assert model.lm_head.weight.is_meta, "lm_head was meant to be offloaded"
    return model


def _learn_token(model: Any) -> None:
    import torch

    learned = torch.linspace(-1.0, 1.0, model.config.hidden_size)
    model.get_input_embeddings().weight.data[int(device_input_ids()[0, 1])] = learned


def _edit_in_place(model: Any) -> None:
    """In-place edits under ``no_grad``, some with operands on the execution device, as a GPU program computes them
    (a 0-dim scale, an index tensor, a row), and a seeded random init (drawn from the execution device's generator
    in memory): the offloaded weight's stored value is in CPU memory."""
    import torch

    device = execution_device()
    with torch.no_grad():
        torch.nn.init.zeros_(model.model.layers[3].mlp.down_proj.weight)
        model.lm_head.weight.mul_(0.5)
        model.lm_head.weight[3] = 1.0
        model.model.layers[3].self_attn.q_proj.weight.data[:, :4] += 1.0
        model.model.layers[3].self_attn.k_proj.weight.mul_(torch.tensor(0.75, device=device))
        model.lm_head.weight.data[torch.tensor(7, device=device)] = torch.full(
            (model.config.hidden_size,), -0.25, device=device)
        torch.manual_seed(0)  # a seeded random init: the in-memory weight's numbers come from the device's generator
        torch.nn.init.normal_(model.model.layers[3].mlp.up_proj.weight, std=0.05)


def _replace(model: Any) -> None:
    """Replace offloaded weights with new tensors, the two ways a program does (values on the execution device)."""
    import torch

    device = main_device()
    head = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(
        torch.linspace(-0.05, 0.05, head.numel(), device=device).reshape(head.shape))
    down = model.model.layers[3].mlp.down_proj.weight
    model.load_state_dict({"model.layers.3.mlp.down_proj.weight": torch.full(down.shape, 0.01, device=device)},
                          strict=False, assign=True)


def _register_bias(model: Any) -> None:
    import torch

    model.model.layers[3].self_attn.q_proj.register_parameter(
        "bias", torch.nn.Parameter(torch.linspace(0.0, 1.0, model.config.hidden_size, device=main_device())))


def textual_inversion(workdir: Path) -> Dict[str, Any]:
    """cpu_offload, then a learned token's row written through ``embedding.weight.data[token] = learned``."""
    return _compare(workdir, _cpu_offloaded, _learn_token)


def in_place_edits(workdir: Path) -> Dict[str, Any]:
    """from_pretrained with layer 3 and lm_head on disk, then in-place edits of their weights under no_grad."""
    return _compare(workdir, _disk_offloaded, _edit_in_place)


def replaced_weights(workdir: Path) -> Dict[str, Any]:
    """from_pretrained with layer 3 and lm_head on disk, then weights replaced: ``lm_head.weight = nn.Parameter(v)``,
    ``load_state_dict(..., assign=True)``."""
    return _compare(workdir, _disk_offloaded, _replace)


def registered_bias(workdir: Path) -> Dict[str, Any]:
    """The same placement, then a bias registered on an offloaded projection (which had none)."""
    return _compare(workdir, _disk_offloaded, _register_bias)


def _saved_resnet(workdir: Path) -> Path:
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    model = ResNetForImageClassification(config).train()
    with torch.no_grad():  # statistics of an earlier training, which a recalibration resets
        model(torch.randn(2, 3, 32, 32))
    model.save_pretrained(workdir / "resnet")
    return workdir / "resnet"


def _batchnorms(model: Any) -> list:
    import torch

    return [module for module in model.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]


def batchnorm_statistics(workdir: Path) -> Dict[str, Any]:
    """A ResNet with its encoder on disk and its buffers offloaded with it (``offload_buffers=True``), its BatchNorm
    statistics recalibrated (``reset_running_stats()``, a cumulative average, forwards in training mode under
    ``no_grad``), then evaluated: the reset writes into the buffers' meta placeholders between forwards, and
    BatchNorm's forward updates the statistics in place, in the loaded tensors the hook drops after it."""
    import torch
    import transformers
    from transformers import ResNetForImageClassification

    checkpoint = _saved_resnet(workdir)
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randn(2, 3, 32, 32, generator=generator).to(main_device()) for _ in range(3)]
    reference = to_device(ResNetForImageClassification.from_pretrained(checkpoint))
    device_map = {"resnet.embedder": main_device(), "resnet.encoder": "disk", "resnet.pooler": main_device(),
                  "classifier": main_device()}
    try:
        model = ResNetForImageClassification.from_pretrained(checkpoint, device_map=device_map, offload_buffers=True,
                                                             offload_folder=str(workdir / "offload"))
    except AttributeError as exc:
        if "is not an nn.Parameter" not in str(exc):
            raise
        # transformers 5.2.0 (measured; 4.57.1 and 5.7.0-5.25.0 load it) asks for the offloaded BatchNorm's
        # running_mean as a tied parameter while it finishes the load, with and without metapatch
        raise NotApplicable(f"transformers {transformers.__version__} cannot load a model with offload_buffers=True "
                            f"({exc})") from None
    assert model.resnet.encoder.stages[0].layers[0].layer[0].normalization.running_mean.is_meta, \
        "the encoder's buffers were meant to be offloaded"
    logits = []
    for net in (reference, model):
        for batchnorm in _batchnorms(net):
            batchnorm.reset_running_stats()
            batchnorm.momentum = None
        net.train()
        with torch.no_grad():
            for batch in batches[:2]:
                net(batch)
        net.eval()
        with torch.no_grad():
            logits.append([net(batches[2]).logits for _ in range(2)])
    (expected, _), (first, second) = logits
    diffs = [max_abs_diff(first, expected), max_abs_diff(second, expected)]
    if max(diffs) != 0:
        raise AssertionError(f"the forward's writes into the offloaded tensors were lost: logits differ from the "
                             f"in-memory model's after the same training-mode forwards by {diffs[0]} (second "
                             f"forward {diffs[1]})")
    return {"max_abs_diff": 0.0, "refused": ""}


SCENARIOS = [
    Scenario(PATCH_ID, "textual-inversion", f"{__name__}:textual_inversion",
             "accelerate.cpu_offload (diffusers' sequential offload), then embedding.weight.data[token] = learned: "
             "upstream the row is written into the meta placeholder and lost, silently",
             expected_error="AssertionError", expected_message="writes into the offloaded weights were lost",
             quick=True),
    Scenario(PATCH_ID, "in-place-edits", f"{__name__}:in_place_edits",
             "layer 3 and lm_head on disk, then torch.nn.init.zeros_, mul_, a row assigned and .data[:, :4] += 1 "
             "under no_grad: upstream every write is lost, silently",
             expected_error="AssertionError", expected_message="writes into the offloaded weights were lost"),
    Scenario(PATCH_ID, "replaced-weights", f"{__name__}:replaced_weights",
             "layer 3 and lm_head on disk, then lm_head.weight = nn.Parameter(v) and load_state_dict(..., "
             "assign=True): upstream the hook loads the stored values over the new tensors at the next forward, "
             "silently",
             expected_error="AssertionError", expected_message="writes into the offloaded weights were lost"),
    Scenario(PATCH_ID, "registered-bias", f"{__name__}:registered_bias",
             "layer 3 on disk, then register_parameter('bias', ...) on its q_proj: upstream the next forward looks the "
             "new tensor up in the hook's weights map, which never stored it",
             expected_error="KeyError", expected_message="q_proj.bias"),
    Scenario(PATCH_ID, "batchnorm-statistics", f"{__name__}:batchnorm_statistics",
             "a ResNet's encoder on disk with offload_buffers=True, BatchNorm recalibrated (reset_running_stats(), two "
             "forwards in training mode under no_grad), then eval: upstream the reset is a no-op on the meta "
             "placeholders and the updated statistics are dropped with the loaded buffers after each forward, "
             "silently",
             expected_error="AssertionError", expected_message="writes into the offloaded tensors were lost"),
]
