"""metapatch doctor"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

from metapatch._records import MetapatchError

HELP = ("load a local checkpoint with a device map (metapatch on), print what is wrong with the placement "
        "(metapatch.diagnose) and run one forward pass")

EPILOG = """examples:
  metapatch doctor ./my-model --device-map auto --max-memory cpu=2GiB,0=20GiB --offload-folder ./offload
  metapatch doctor ./my-model --device-map '{"model.embed_tokens": 0, "model.layers": "cpu", "lm_head": 0}'
exit code: 0 when the report has no errors/warnings and the forward pass ran with finite outputs; 1 when the
report has errors/warnings, loading fails or the forward pass fails; 2 on bad arguments (a folder without
config.json, a device map that is not JSON, names no module of the model or a device that is not here, a bad
budget, dtype or offload folder): one line on stderr.
The forward pass feeds a few token ids (encoder-decoder models also get decoder ids); a model that needs other
inputs (pixels, audio) is loaded and diagnosed, and the forward pass is reported as skipped.
Nothing is downloaded; disk offload writes only into --offload-folder.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a local folder with config.json and weights")
    parser.add_argument("--device-map", default="auto",
                        help="auto|balanced|sequential|cpu|cuda:0, a JSON object, or a .json file (default auto)")
    parser.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                        help="per-device budget, e.g. cpu=2GiB,0=20GiB")
    parser.add_argument("--offload-folder", default=None, metavar="DIR", help="where disk-offloaded weights go")
    parser.add_argument("--dtype", default=None, help="torch dtype to load in (e.g. float16); default: the checkpoint's")
    parser.add_argument("--no-forward", action="store_true", help="only load and diagnose")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def parse_device_map(value: str) -> Union[str, Dict[str, Any]]:
    text = value.strip()
    if text.startswith(("{", "[")):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MetapatchError(f"--device-map is not valid JSON: {exc}") from None
    elif text.endswith(".json"):
        path = Path(text)
        if not path.is_file():
            raise MetapatchError(f"--device-map {text}: no such file" if not path.exists()
                                 else f"--device-map {text} is not a file")
        try:
            mapping = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MetapatchError(f"--device-map {text} is not a JSON file: {exc}") from None
    elif text in _STRATEGIES or _is_device(text):
        return int(text) if text.isdigit() else text
    else:
        raise MetapatchError(f"--device-map {text!r} is none of {', '.join(_STRATEGIES)}, a device (cpu, cuda:0, 0), "
                             "a JSON object or a .json file")
    if not isinstance(mapping, dict):
        raise MetapatchError("--device-map JSON must be an object {module name: device}")
    return {str(k): _device_value(v) for k, v in mapping.items()}


_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _is_device(text: str) -> bool:
    import re

    return bool(re.fullmatch(r"\d+|cpu|disk|meta|(cuda|xpu|npu|mlu|musa|hpu|mps|sdaa)(:\d+)?", text))


def _device_value(value: Any) -> Any:
    return int(value) if isinstance(value, str) and value.isdigit() else value


def check_devices(device_map: Union[str, int, Dict[str, Any]]) -> None:
    """MetapatchError for a device that does not exist on this machine (cuda:1 with one GPU, cuda without CUDA)."""
    import torch

    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise MetapatchError(f"--device-map: {value!r} is not a device (cpu, disk, cuda:0, 0, ...)")
        if isinstance(value, str) and (value in _STRATEGIES or value in ("cpu", "disk", "meta")):
            continue
        if isinstance(value, str) and not _is_device(value):
            raise MetapatchError(f"--device-map: {value!r} is not a device (cpu, disk, cuda:0, 0, ...)")
        device = torch.device(f"cuda:{value}" if isinstance(value, int) else value)
        backend = getattr(torch, device.type, None)
        available = backend is not None and getattr(backend, "is_available", lambda: False)()
        count = getattr(backend, "device_count", lambda: 1)() if available else 0
        if not available or (device.index is not None and device.index >= count):
            raise MetapatchError(f"--device-map: device {value!r} is not on this machine "
                                 f"({device.type} devices here: {count})")


def check_module_names(model_class: Any, config: Any, device_map: Dict[str, Any]) -> None:
    """MetapatchError when a device map names modules the model does not have (transformers would ignore
    them, or fail much later with an error about something else)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        skeleton = model_class.from_config(config) if hasattr(model_class, "from_config") else model_class._from_config(config)
    names = {name for name, _ in skeleton.named_modules()}
    names |= {name for name, _ in skeleton.named_parameters()} | {name for name, _ in skeleton.named_buffers()}
    unknown = [key for key in device_map if key != "" and key not in names]
    if unknown:
        top = sorted(name for name, _ in skeleton.named_children())
        raise MetapatchError(f"--device-map names {len(unknown)} module(s) {type(skeleton).__name__} does not have: "
                             f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} (its top-level modules: "
                             f"{', '.join(top)})")


def parse_max_memory(value: Optional[str]) -> Optional[Dict[Any, str]]:
    import re

    if not value:
        return None
    budget: Dict[Any, str] = {}
    for part in value.split(","):
        device, sep, size = part.partition("=")
        device, size = device.strip(), size.strip()
        if not sep or not device or not size:
            raise MetapatchError(f"--max-memory entry {part!r} is not DEVICE=SIZE (e.g. cpu=2GiB,0=20GiB)")
        if not re.fullmatch(r"\d+(\.\d+)?\s*([KMGT]i?B)?", size, re.IGNORECASE):
            raise MetapatchError(f"--max-memory entry {part!r}: {size!r} is not a size (e.g. 300KB, 2GiB, 20GB)")
        if not (_is_device(device) and device not in ("disk", "meta")):
            raise MetapatchError(f"--max-memory entry {part!r}: {device!r} is not a device (cpu, 0, cuda:0, ...)")
        budget[_device_value(device)] = size
    return budget


def _model_class(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM if hasattr(config, "vocab_size") else transformers.AutoModel


def _check_dtype(name: str) -> None:
    import torch

    if name != "auto" and not isinstance(getattr(torch, name, None), torch.dtype):
        raise MetapatchError(f"--dtype {name!r} is not a torch dtype (float32, float16, bfloat16, auto)")


def _check_offload_folder(folder: str) -> None:
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise MetapatchError(f"--offload-folder {folder} is not a folder")
    if not path.exists() and not path.parent.is_dir():
        raise MetapatchError(f"--offload-folder {folder}: {path.parent} does not exist")


def arguments(args: argparse.Namespace) -> "tuple[Path, Dict[str, Any]]":
    """The checkpoint folder and from_pretrained's keyword arguments; MetapatchError for bad input, checked before
    anything loads."""
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise MetapatchError(f"{checkpoint}: no such folder" if not checkpoint.exists() else f"{checkpoint} is not a folder")
    if not (checkpoint / "config.json").is_file():
        raise MetapatchError(f"{checkpoint} has no config.json: doctor loads local checkpoints only (no downloads)")
    kwargs: Dict[str, Any] = {"device_map": parse_device_map(args.device_map), "local_files_only": True}
    max_memory = parse_max_memory(args.max_memory)
    if max_memory:
        kwargs["max_memory"] = max_memory
    if args.offload_folder:
        _check_offload_folder(args.offload_folder)
        kwargs["offload_folder"] = args.offload_folder
    if args.dtype:
        _check_dtype(args.dtype)
        kwargs["dtype"] = args.dtype
    check_devices(kwargs["device_map"])
    if max_memory:
        check_devices({str(k): k for k in max_memory})
    return checkpoint, kwargs


def load(args: argparse.Namespace) -> Any:
    import transformers

    checkpoint, kwargs = arguments(args)
    try:
        config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot read is bad input
        raise MetapatchError(f"{checkpoint}/config.json cannot be read by transformers: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]}") from None
    model_class = _model_class(config)
    if isinstance(kwargs["device_map"], dict):
        check_module_names(model_class, config, kwargs["device_map"])
    return model_class.from_pretrained(checkpoint, **kwargs).eval()


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def model_inputs(model: Any, device: Any) -> Optional[Dict[str, Any]]:
    """A few token ids for ``model``'s forward (with decoder ids for an encoder-decoder model), or None where
    the model takes no token ids (vision, audio)."""
    import inspect

    import torch

    config = getattr(model, "config", None)
    try:
        accepted = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepted = {"input_ids": None}
    if "input_ids" not in accepted:
        return None
    vocab = getattr(_text_config(config), "vocab_size", None) or getattr(config, "vocab_size", None) or 32
    ids = torch.randint(0, int(vocab), (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    inputs: Dict[str, Any] = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in accepted:
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(config, "pad_token_id", None) or 0
        inputs["decoder_input_ids"] = torch.full((1, 1), int(start), dtype=torch.long, device=device)
    return inputs


def forward_once(model: Any) -> Dict[str, Any]:
    """One forward pass on a few random token ids, sent where the input embeddings compute."""
    import torch

    from metapatch.diagnose import _input_device

    device = _input_device(model) or "cpu"
    inputs = model_inputs(model, device)
    if inputs is None:
        return {"ran": False, "skipped": f"{type(model).__name__}.forward takes no input_ids (it needs other "
                                         "inputs: pixels, audio); the placement report above still holds"}
    started = time.perf_counter()
    try:
        with torch.no_grad():
            output = model(**inputs)
    except Exception as exc:
        return {"ran": False, "error_type": type(exc).__name__, "error": str(exc)[:1000],
                "seconds": round(time.perf_counter() - started, 3)}
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = getattr(output, "last_hidden_state", None)
    result: Dict[str, Any] = {"ran": True, "seconds": round(time.perf_counter() - started, 3), "input_device": device}
    if logits is not None:
        result.update(shape=list(logits.shape), device=str(logits.device),
                      finite=bool(torch.isfinite(logits.float()).all()))
    return result


def forward_ok(forward: Optional[Dict[str, Any]]) -> bool:
    """Whether the forward pass (None: not asked for; skipped: the model takes no token ids) leaves the verdict ok."""
    return forward is None or bool(forward.get("skipped")) or (forward["ran"] and forward.get("finite", True))


def forward_line(forward: Dict[str, Any]) -> str:
    if forward.get("skipped"):
        return f"  forward pass: skipped: {forward['skipped']}"
    if not forward["ran"]:
        return f"  forward pass: FAILED: {forward['error_type']}: {forward['error']}"
    finite = "" if forward.get("finite", True) else " (NOT finite: some outputs are nan/inf)"
    return (f"  forward pass: ok in {forward['seconds']} s, output {forward.get('shape')} on "
            f"{forward.get('device')}{finite}")


def verdict_text(report: Any, forward: Optional[Dict[str, Any]]) -> str:
    problems = [] if report.ok else ["the placement has errors or warnings"]
    if not forward_ok(forward):
        problems.append("the forward pass failed" if not forward["ran"] else "the forward pass gave nan/inf")
    return "  verdict: " + ("ok" if not problems else "problems found: " + "; ".join(problems))


def run(args: argparse.Namespace) -> int:
    import importlib.util

    import metapatch
    from metapatch.diagnose import diagnose

    missing = [name for name in ("torch", "transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"metapatch doctor: {', '.join(missing)} not installed: doctor loads the checkpoint with transformers "
              "(pip install 'metapatch[hf]')", file=sys.stderr)
        return 2
    try:
        model = load(args)
    except MetapatchError as exc:
        print(f"metapatch doctor: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # Loading itself failing is the diagnosis: say so, with the patches that were active.
        states = {r["id"]: r["state"] for r in metapatch.status()}
        result = {"loaded": False, "error_type": type(exc).__name__, "error": str(exc)[:2000], "patches": states}
        print(json.dumps(result, indent=2) if args.json
              else f"metapatch doctor: loading {args.checkpoint} failed: {type(exc).__name__}: {exc}")
        return 1
    report = diagnose(model)
    forward = None if args.no_forward else forward_once(model)
    ok = report.ok and forward_ok(forward)
    if args.json:
        print(json.dumps({"loaded": True, "ok": ok, "report": report.to_dict(), "forward": forward,
                          "hf_device_map": {k: str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()}},
                         indent=2))
    else:
        lines = str(report).splitlines()
        lines = [("  no placement problems found" if line == "  no problems found" else line)
                 for line in lines if not line.startswith("  verdict: ")]
        if forward is not None:
            lines.append(forward_line(forward))
        lines.append(verdict_text(report, forward))
        print("\n".join(lines))
    return 0 if ok else 1
