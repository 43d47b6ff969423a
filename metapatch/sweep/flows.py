"""The flows the sweep runs beside the float32 placements (metapatch.sweep.child), each over one placement
chosen for the bug class it reaches, each compared with the same flow on the in-memory model:

* ``float16``: ``from_pretrained(..., dtype=torch.float16)`` with layers 1, 3, 5... on disk, where the
  ``_keep_in_fp32_modules`` live (T5's ``wo`` stays float32 in memory); ``bfloat16``: the same with every
  top-level unit but the layers (embeddings, head) on disk. Each over a placement that works upstream in
  float32 for most architectures, so an upstream failure in these columns is the dtype's own. Every
  parameter's dtype as in memory, logits equal (no tolerance: the same CPU kernels run on the same
  weights) and the same greedy ``generate`` tokens;
* ``pipeline``: ``transformers.pipeline("text-generation", model=..., tokenizer=...)`` over the model with its
  first top-level unit on disk (the first ``hf_device_map`` value is ``"disk"``, where ``Pipeline.__init__``
  takes its device from), with a word-level tokenizer built locally; greedy tokens equal;
* ``new-head``: ``AutoModelForSequenceClassification`` saved with 2 labels, loaded with
  ``num_labels=3, ignore_mismatched_sizes=True`` and the head (the units whose shapes change with
  ``num_labels``) on disk: the head has the in-memory shape and dtype, the other tensors are the
  checkpoint's, and the logits equal those of the in-memory model holding the offloaded model's own weights
  (its new head is random: only the same weights make the same numbers).

A flow the architecture cannot run in memory (no sequence-classification class, a dtype its kernels lack on
CPU, a model the text-generation pipeline does not take) is ``n/a`` with the in-memory error as its detail.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

FLOWS = ("float16", "bfloat16", "pipeline", "new-head")

DESCRIPTIONS = {
    "float16": "`dtype=torch.float16` with layers 1, 3, 5... on disk (`alternate-layers-on-disk`, where the "
               "`_keep_in_fp32_modules` live: T5's `wo`); parameter dtypes, logits (exactly, no tolerance) and "
               "greedy tokens equal to the in-memory float16 model's",
    "bfloat16": "the same with `dtype=torch.bfloat16` and every top-level unit but the layers on disk "
                "(`non-layers-on-disk`)",
    "pipeline": "`pipeline(\"text-generation\", model=..., tokenizer=...)` (a local word-level tokenizer) over the "
                "model with its first top-level unit on disk (the first `hf_device_map` value is `disk`); greedy "
                "3-token output equal to the in-memory model's pipeline",
    "new-head": "`AutoModelForSequenceClassification` saved with 2 labels, loaded with `num_labels=3, "
                "ignore_mismatched_sizes=True` and the head on disk; head shape/dtype as in memory, the other "
                "tensors the checkpoint's, logits equal to the in-memory model holding the same weights",
}

NEW_LABELS = 3


class NotApplicable(Exception):
    """The flow does not run on this architecture in memory (the reason is the cell's detail)."""


PLACEMENT = {"float16": "alternate-layers-on-disk", "bfloat16": "non-layers-on-disk", "pipeline": "first-on-disk"}


def run_all(ctx: Dict[str, Any], helpers: Dict[str, Callable[..., Any]]) -> Dict[str, Dict[str, Any]]:
    """Every flow of one architecture: ``{flow: {"status": ok|wrong|error|n/a, ...}}``."""
    import time

    import torch

    runners = {"float16": lambda: _dtype_flow(ctx, helpers, torch.float16),
               "bfloat16": lambda: _dtype_flow(ctx, helpers, torch.bfloat16),
               "pipeline": lambda: _pipeline_flow(ctx, helpers),
               "new-head": lambda: _new_head_flow(ctx, helpers)}
    rows: Dict[str, Dict[str, Any]] = {}
    for name in FLOWS:
        started = time.perf_counter()
        try:
            row = runners[name]()
        except NotApplicable as exc:
            row = {"status": "n/a", "detail": str(exc)[:300]}
        except BaseException as exc:  # noqa: BLE001 - the offloaded flow's failure is the cell
            row = {"status": "error", **helpers["error"](exc)}
        row["seconds"] = round(time.perf_counter() - started, 2)
        rows[name] = row
        helpers["free"]()
    return rows


def _in_memory(what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except BaseException as exc:  # noqa: BLE001 - the flow does not run in memory: not an offload bug
        raise NotApplicable(f"in memory: {type(exc).__name__}: {' '.join(str(exc).split())[:200]} ({what})") from exc


def _exact(got: Any, expected: Any) -> Any:
    """None when equal (NaN where NaN), else why not."""
    import torch

    if got.shape != expected.shape:
        return f"logits shape {tuple(got.shape)} != {tuple(expected.shape)}"
    if torch.allclose(got, expected, atol=0.0, rtol=0.0, equal_nan=True):
        return None
    both = torch.isfinite(got) & torch.isfinite(expected)
    diff = float((got - expected)[both].abs().max()) if both.any() else float("nan")
    return f"logits differ (max abs diff {diff:.3g})"


def _dtype_flow(ctx: Dict[str, Any], helpers: Dict[str, Callable[..., Any]], dtype: Any) -> Dict[str, Any]:
    from metapatch.sweep import placements

    cls, checkpoint, inputs = ctx["model_class"], ctx["checkpoint"], ctx["inputs"]
    kw = {ctx["dtype_key"]: dtype}
    device_map = placements.device_map(PLACEMENT[str(dtype)[6:]], ctx["top"], ctx["layer_lists"], ctx["main"])
    if not device_map:
        raise NotApplicable("nothing to place this way")

    def reference() -> Dict[str, Any]:
        model = cls.from_pretrained(checkpoint, **kw).eval()
        found = {"logits": helpers["logits"](model, inputs), "tokens": helpers["generate"](model, inputs),
                 "dtypes": {n: p.dtype for n, p in model.named_parameters()}}
        del model
        return found

    expected = _in_memory(str(dtype), reference)
    helpers["free"]()
    model = cls.from_pretrained(checkpoint, device_map=device_map, **kw,
                                offload_folder=os.path.join(ctx["workdir"], f"offload-{str(dtype)[6:]}")).eval()
    why = _exact(helpers["logits"](model, inputs), expected["logits"])
    tokens = helpers["generate"](model, inputs)
    # Compared after the same calls as the in-memory model's: a forward may convert a module for good
    # (SwitchTransformers' router puts its classifier in float32 inside its forward).
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    differing = sorted(n for n in expected["dtypes"] if dtypes.get(n) != expected["dtypes"][n])
    if differing:
        name = differing[0]
        return {"status": "wrong", "detail": f"{len(differing)} parameter dtype(s) differ: {name} is "
                                             f"{dtypes.get(name)}, {expected['dtypes'][name]} in memory; "
                                             f"{why or 'logits equal'}"}
    if why:
        return {"status": "wrong", "detail": why}
    if tokens.shape != expected["tokens"].shape or not bool((tokens == expected["tokens"]).all()):
        return {"status": "wrong", "detail": f"generate gave {tokens.tolist()} != {expected['tokens'].tolist()}"}
    return {"status": "ok", "detail": "equal"}


_SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")


def _word(i: int) -> str:
    """Token ``i``'s word; the special tokens are not words of the others (an added token matches inside words)."""
    return _SPECIAL[i] if i < len(_SPECIAL) else f"w{i}"


def _tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({_word(i): i for i in range(vocab)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _start_token(config: Any) -> int:
    """A config rebuilt from a dict can lose its generation defaults (the sweep's ``_generate`` does the same)."""
    for name in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _generation_defaults(model: Any) -> None:
    """What generate needs and a tiny config may lack, set the same way on the in-memory and offloaded model."""
    generation = model.generation_config
    if generation.pad_token_id is None:
        generation.pad_token_id = 0
    if model.config.is_encoder_decoder and generation.decoder_start_token_id is None:
        generation.decoder_start_token_id = _start_token(generation)


def _pipeline_flow(ctx: Dict[str, Any], helpers: Dict[str, Callable[..., Any]]) -> Dict[str, Any]:
    import transformers

    from metapatch.sweep import placements

    cls, checkpoint = ctx["model_class"], ctx["checkpoint"]
    top = ctx["top"]
    if not top:
        raise NotApplicable("no top-level unit to put on disk")
    text = " ".join(_word(int(i)) for i in ctx["inputs"]["input_ids"][0])
    tokenizer = _tokenizer(min(max(ctx["vocab"], 8), 4096))
    options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, num_beams=1, return_tensors=True)

    def run(model: Any) -> Any:
        _generation_defaults(model)
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
        return [row["generated_token_ids"] for row in pipe(text, **options)]

    expected = _in_memory("text-generation pipeline", lambda: run(cls.from_pretrained(checkpoint, **ctx["dtype_kw"]).eval()))
    helpers["free"]()
    device_map = placements.device_map(PLACEMENT["pipeline"], top, ctx["layer_lists"], ctx["main"])
    model = cls.from_pretrained(checkpoint, device_map=device_map, **ctx["dtype_kw"],
                                offload_folder=os.path.join(ctx["workdir"], "offload-pipeline")).eval()
    got = run(model)
    if got != expected:
        return {"status": "wrong", "detail": f"pipeline gave {got} != {expected}"}
    return {"status": "ok", "detail": "equal"}


def _new_head_flow(ctx: Dict[str, Any], helpers: Dict[str, Callable[..., Any]]) -> Dict[str, Any]:
    import torch
    import transformers
    from accelerate.utils.modeling import get_state_dict_offloaded_model
    from transformers import AutoModelForSequenceClassification
    from transformers.models.auto import modeling_auto

    from metapatch.sweep import placements

    name = modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(ctx["model_type"])
    seq_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if seq_class is None:
        raise NotApplicable(f"no sequence-classification class for {ctx['model_type']}")
    checkpoint = os.path.join(ctx["workdir"], "checkpoint-classifier")
    config = ctx["config"]
    ids = ctx["inputs"]["input_ids"].clone()
    eos = getattr(config.get_text_config(), "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0]
    if eos is not None:  # encoder-decoder heads pool the hidden state of the eos token
        ids[0, -1] = eos
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = _start_token(config)  # T5's head shifts input_ids right with it

    def build() -> Any:
        config.num_labels = 2
        torch.manual_seed(0)
        built = seq_class(config).eval()
        built.save_pretrained(checkpoint)
        config.num_labels = NEW_LABELS
        with torch.device("meta"):
            resized = dict(seq_class(config).named_parameters())
        changed = sorted(n for n, p in built.named_parameters() if n in resized and resized[n].shape != p.shape)
        top, _ = placements.units(built)
        heads = [u for u in top if any(n.startswith(u + ".") or n == u for n in changed)]
        if not heads:
            raise ValueError("no parameter changes shape with num_labels")
        layer_lists = placements.units(built)[1]
        del built
        return top, layer_lists, heads, changed

    top, layer_lists, heads, changed = _in_memory(seq_class.__name__, build)

    def load(**kwargs: Any) -> Any:
        return AutoModelForSequenceClassification.from_pretrained(
            checkpoint, num_labels=NEW_LABELS, ignore_mismatched_sizes=True, **ctx["dtype_kw"], **kwargs).eval()

    def reference() -> Any:
        model = load()
        helpers["logits"](model, inputs)
        return model

    memory = _in_memory(f"{seq_class.__name__} num_labels={NEW_LABELS}", reference)
    device_map = {unit: ctx["main"] for unit in top}
    for layers in layer_lists:
        device_map.update({layer: ctx["main"] for layer in layers})
    device_map.update({unit: "disk" for unit in heads})
    model = load(device_map=device_map, offload_folder=os.path.join(ctx["workdir"], "offload-new-head"))
    logits = helpers["logits"](model, inputs)
    state = {n: t.detach().cpu().clone() for n, t in get_state_dict_offloaded_model(model).items()}
    own = memory.state_dict()
    for n in changed:
        if n not in state or state[n].shape != own[n].shape or state[n].dtype != own[n].dtype:
            got = (tuple(state[n].shape), state[n].dtype) if n in state else "absent"
            return {"status": "wrong", "detail": f"{n} is {got}; in memory {tuple(own[n].shape)} {own[n].dtype}"}
    kept = [n for n in own if n not in changed and n in state and not torch.equal(state[n].to(own[n].device), own[n])]
    if kept:
        return {"status": "wrong", "detail": f"{len(kept)} checkpoint tensor(s) differ, e.g. {kept[0]}"}
    missing, unexpected = memory.load_state_dict(state, strict=False)
    if missing or unexpected:
        return {"status": "wrong", "detail": f"offloaded weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}"}
    why = _exact(logits, helpers["logits"](memory, inputs))
    if why:
        return {"status": "wrong", "detail": why}
    return {"status": "ok", "detail": f"equal; head {', '.join(heads)} on disk"}
