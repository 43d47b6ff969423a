"""Reproducers for ``offloaded-training-refusal``: training a model whose trainable parameters accelerate offloaded.

A tiny Llama is loaded with a real ``from_pretrained(device_map=..., offload_folder=...)`` that puts ``lm_head`` and
layer 3 on disk (their parameters become meta placeholders behind accelerate offload hooks, still trainable). The
same training step (``torch.optim.AdamW(model.parameters())``, or transformers' ``Trainer.train()``) runs on an
in-memory copy, the oracle. Upstream the offloaded step runs and leaves every offloaded weight at its checkpoint
value (the gradients landed on the copies the hooks loaded for the forward, and were dropped with them): the
logits after the step differ from the in-memory model's, silently, and the scenario fails with that
``AssertionError``. Fixed means: the step raises an error that names the offload and says to freeze the offloaded
weights (``requires_grad_``), before anything is updated, so the model still computes the untrained in-memory
logits. The map's memory entries and the reference are on the execution device (``_device``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict

from ._device import main_device, to_device
from ._harness import Scenario
from ._models import device_input_ids, max_abs_diff, save_tiny_llama

PATCH_ID = "offloaded-training-refusal"

DEVICE_MAP = {
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
    "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "disk",
}


def _load(workdir: Path, offloaded: bool) -> Any:
    from transformers import LlamaForCausalLM

    if not offloaded:
        return to_device(LlamaForCausalLM.from_pretrained(workdir / "ckpt"))
    device_map = {name: main_device() if device == "cpu" else device for name, device in DEVICE_MAP.items()}
    model = LlamaForCausalLM.from_pretrained(workdir / "ckpt", device_map=device_map,
                                             offload_folder=str(workdir / "offload"))
    assert model.lm_head.weight.is_meta and model.lm_head.weight.requires_grad, "lm_head was meant to be offloaded"
    return model


def _logits(model: Any) -> Any:
    import torch

    model.eval()
    with torch.no_grad():
        return model(device_input_ids()).logits


def is_refusal(exc: BaseException) -> bool:
    """An error that explains the offloaded trainable parameters and what to do (metapatch's or a fixed release's)."""
    text = str(exc)
    return "offload" in text and "requires_grad" in text


def _compare(workdir: Path, train: Callable[[Any], None]) -> Dict[str, Any]:
    save_tiny_llama(workdir / "ckpt")
    untrained = _logits(_load(workdir, offloaded=False))
    reference = _load(workdir, offloaded=False)
    train(reference)
    trained = _logits(reference)
    assert max_abs_diff(trained, untrained) > 0, "the in-memory step changed nothing: the comparison would be vacuous"
    model = _load(workdir, offloaded=True)
    try:
        train(model)
    except Exception as exc:  # noqa: BLE001 - judged below
        if not is_refusal(exc):
            raise
        # refused before anything was updated: the model still computes the untrained in-memory logits
        diff = max_abs_diff(_logits(model), untrained)
        if diff != 0:
            raise AssertionError(f"the refused step changed the offloaded model (logits off by {diff})") from exc
        return {"max_abs_diff": diff, "refused": type(exc).__name__}
    diff = max_abs_diff(_logits(model), trained)
    if diff != 0:
        raise AssertionError(f"the training step ran on the offloaded model but did not train its offloaded "
                             f"parameters: logits differ from the in-memory model's after the same step by {diff}")
    return {"max_abs_diff": diff, "refused": ""}


def _adamw_steps(model: Any, steps: int = 1, accumulate: int = 1) -> None:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = device_input_ids()
    model.train()
    for _ in range(steps):
        for _ in range(accumulate):
            (model(input_ids=ids, labels=ids).loss / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()


def adamw_step(workdir: Path) -> Dict[str, Any]:
    """A plain loop: torch.optim.AdamW(model.parameters()), forward, backward, step."""
    return _compare(workdir, _adamw_steps)


def trainer_train(workdir: Path) -> Dict[str, Any]:
    """transformers' Trainer.train() on a tiny dataset (two steps)."""
    from transformers import Trainer, TrainingArguments

    ids = device_input_ids().cpu()[0]
    dataset = [{"input_ids": ids, "labels": ids}] * 4

    def train(model: Any) -> None:
        args = TrainingArguments(output_dir=str(workdir / "trainer"), max_steps=2, per_device_train_batch_size=2,
                                 learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=dataset).train()

    return _compare(workdir, train)


SCENARIOS = [
    Scenario(PATCH_ID, "adamw-step", f"{__name__}:adamw_step",
             "AdamW step on a Llama whose lm_head and layer 3 are on disk (trainable): upstream the offloaded weights "
             "stay untrained, silently; fixed, the step is refused and the model is left unchanged",
             expected_error="AssertionError", expected_message="did not train its offloaded parameters", quick=True),
    Scenario(PATCH_ID, "trainer-train", f"{__name__}:trainer_train",
             "transformers Trainer.train() on the same model: the same silent non-training upstream, refused fixed",
             expected_error="AssertionError", expected_message="did not train its offloaded parameters"),
]
