"""One leg of one architecture, in its own process:
``python -m metapatch.sweep.child CLASS MODEL_TYPE LEG WORKDIR RESULT_JSON``.

LEG ``unpatched`` runs with ``METAPATCH_DISABLE=all`` set by the parent and never imports
metapatch's patches; ``patched`` imports metapatch before torch/transformers, as a user script
does. Both build the same tiny random model (seed 0), save it, load it back in memory as the
reference, then load it with each placement and compare logits and a short greedy ``generate``;
then the flows of metapatch.sweep.flows (float16/bfloat16 loads, a text-generation pipeline, a resized
sequence-classification head), each over its own placement.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, Dict

ATOL = 1e-5
RTOL = 1e-4
NEW_TOKENS = 3
MAX_PARAMETERS = 5_000_000


def _error(exc: BaseException) -> Dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    message = " ".join(str(exc).split())[:300]
    return {"type": type(exc).__name__, "message": message, "where": where,
            "metapatch": any(c.__module__.startswith("metapatch") for c in type(exc).__mro__)}


def _inputs(model: Any) -> Dict[str, Any]:
    import torch

    vocab = int(getattr(model.config.get_text_config(), "vocab_size", None) or 128)
    ids = torch.randint(4, max(5, min(vocab, 200)), (1, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, :4]
    return inputs


def _logits(model: Any, inputs: Dict[str, Any]) -> Any:
    import torch

    device = model.device
    with torch.no_grad():
        out = model(**{k: v.to(device) for k, v in inputs.items()})
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0]
    return logits.detach().float().cpu()


def _generate(model: Any, inputs: Dict[str, Any]) -> Any:
    import torch

    device = model.device
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    extra = {}
    if model.config.is_encoder_decoder:
        start = config.decoder_start_token_id
        # A config rebuilt from a dict can lose its generation defaults; 0 is T5/BART's usual start.
        extra["decoder_start_token_id"] = start if start is not None else (config.bos_token_id or pad or 0)
    with torch.no_grad():
        out = model.generate(inputs["input_ids"].to(device), attention_mask=inputs["attention_mask"].to(device),
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                             pad_token_id=pad, **extra)
    return out.cpu()


def _compare(reference: Dict[str, Any], model: Any, inputs: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    logits = _logits(model, inputs)
    if logits.shape != reference["logits"].shape:
        return {"status": "wrong", "detail": f"logits shape {tuple(logits.shape)} != {tuple(reference['logits'].shape)}"}
    diff = float((logits - reference["logits"]).abs().max()) if logits.numel() else 0.0
    if not torch.allclose(logits, reference["logits"], atol=ATOL, rtol=RTOL, equal_nan=True):
        return {"status": "wrong", "detail": f"logits differ (max abs diff {diff:.3g})"}
    tokens = _generate(model, inputs)
    if not torch.equal(tokens, reference["tokens"]):
        return {"status": "wrong", "detail": f"generate gave {tokens.tolist()} != {reference['tokens'].tolist()}"}
    return {"status": "ok", "detail": "equal" if diff == 0 else f"max abs diff {diff:.3g}"}


def _free(*models: Any) -> None:
    for model in models:
        del model
    gc.collect()


def run(class_name: str, model_type: str, leg: str, workdir: str) -> Dict[str, Any]:
    if leg == "patched":
        import metapatch  # noqa: F401 - before torch/transformers, as a user script
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from metapatch.sweep import placements, shrink

    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    result: Dict[str, Any] = {"arch": class_name, "model_type": model_type, "leg": leg, "placements": {}}
    started = time.perf_counter()
    checkpoint = os.path.join(workdir, "checkpoint")
    try:
        model_class = getattr(transformers, class_name)
        config = shrink.tiny_config(CONFIG_MAPPING[model_type])
        with torch.device("meta"):  # size it before allocating: a config the rules missed must not exhaust memory
            size = sum(p.numel() for p in model_class(config).parameters())
        if size > MAX_PARAMETERS:
            raise ValueError(f"still {size / 1e6:.1f}M parameters after shrinking (limit {MAX_PARAMETERS / 1e6:.0f}M): "
                             f"a size attribute the rules in metapatch/sweep/shrink.py do not know")
        torch.manual_seed(0)
        built = model_class(config).eval()
        result["parameters"] = sum(p.numel() for p in built.parameters())
        built.save_pretrained(checkpoint)
        _free(built)
    except BaseException as exc:  # noqa: BLE001 - any failure is the row's reason
        result["build"] = _error(exc)
        return result
    try:
        model = model_class.from_pretrained(checkpoint, **dtype_kw).eval()
        inputs = _inputs(model)
        reference = {"logits": _logits(model, inputs), "tokens": _generate(model, inputs)}
        result["reference_sha"] = hashlib.sha256(reference["logits"].numpy().tobytes()).hexdigest()[:16]
        top, layer_lists = placements.units(model)
        result["units"] = {"top": top, "layers": [len(x) for x in layer_lists]}
        _free(model)
    except BaseException as exc:  # noqa: BLE001
        result["reference"] = _error(exc)
        return result
    result["build_s"] = round(time.perf_counter() - started, 2)
    gpu = torch.cuda.is_available()
    main = 0 if gpu else "cpu"
    for name in placements.PLACEMENTS:
        row_started = time.perf_counter()
        device_map = placements.device_map(name, top, layer_lists, main)
        if not device_map:
            result["placements"][name] = {"status": "n/a", "detail": "nothing to place this way"}
            continue
        model = None
        try:
            if name == "cpu-offload" and not gpu:
                import accelerate

                model = model_class.from_pretrained(checkpoint, **dtype_kw).eval()
                accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
            else:
                model = model_class.from_pretrained(checkpoint, device_map=device_map,
                                                    offload_folder=os.path.join(workdir, f"offload-{name}"),
                                                    **dtype_kw).eval()
            row = _compare(reference, model, inputs)
        except BaseException as exc:  # noqa: BLE001
            row = {"status": "error", **_error(exc)}
        row["seconds"] = round(time.perf_counter() - row_started, 2)
        result["placements"][name] = row
        _free(model)
    from metapatch.sweep import flows

    context = {"model_class": model_class, "model_type": model_type, "checkpoint": checkpoint, "workdir": workdir,
               "inputs": inputs, "top": top, "layer_lists": layer_lists, "main": main, "dtype_kw": dtype_kw,
               "dtype_key": next(iter(dtype_kw)), "config": shrink.tiny_config(CONFIG_MAPPING[model_type]),
               "vocab": int(getattr(config.get_text_config(), "vocab_size", None) or 128)}
    helpers = {"logits": _logits, "generate": _generate, "error": _error, "free": gc.collect}
    result["flows"] = flows.run_all(context, helpers)
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def main(argv: Any = None) -> int:
    class_name, model_type, leg, workdir, out = (argv or sys.argv[1:])[:5]
    try:
        result = run(class_name, model_type, leg, workdir)
    except BaseException as exc:  # noqa: BLE001
        result = {"arch": class_name, "model_type": model_type, "leg": leg, "crash": _error(exc)}
    try:
        import accelerate
        import torch
        import transformers

        result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                              "accelerate": accelerate.__version__}
    except Exception:
        pass
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
