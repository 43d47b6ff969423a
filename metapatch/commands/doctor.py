"""metapatch doctor"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

from metapatch._framework.records import MetapatchError

HELP = ("load a local checkpoint with a device map (metapatch on), print what is wrong with the placement "
        "(metapatch.diagnose) and run one forward pass")

EPILOG = """examples:
  metapatch doctor ./my-model --device-map auto --max-memory cpu=2GiB,0=20GiB --offload-folder ./offload
  metapatch doctor ./my-model --device-map '{"model.embed_tokens": 0, "model.layers": "cpu", "lm_head": 0}'
exit code: 0 when the report has no errors/warnings and the forward pass ran, 1 otherwise, 2 on bad arguments.
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
    elif text.endswith(".json") and Path(text).is_file():
        mapping = json.loads(Path(text).read_text())
    else:
        return text
    if not isinstance(mapping, dict):
        raise MetapatchError("--device-map JSON must be an object {module name: device}")
    return {str(k): _device_value(v) for k, v in mapping.items()}


def _device_value(value: Any) -> Any:
    return int(value) if isinstance(value, str) and value.isdigit() else value


def parse_max_memory(value: Optional[str]) -> Optional[Dict[Any, str]]:
    if not value:
        return None
    budget: Dict[Any, str] = {}
    for part in value.split(","):
        device, sep, size = part.partition("=")
        device, size = device.strip(), size.strip()
        if not sep or not device or not size:
            raise MetapatchError(f"--max-memory entry {part!r} is not DEVICE=SIZE (e.g. cpu=2GiB,0=20GiB)")
        budget[_device_value(device)] = size
    return budget


def _model_class(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM if hasattr(config, "vocab_size") else transformers.AutoModel


def load(args: argparse.Namespace) -> Any:
    import transformers

    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise MetapatchError(f"{checkpoint} has no config.json: doctor loads local checkpoints only (no downloads)")
    kwargs: Dict[str, Any] = {"device_map": parse_device_map(args.device_map), "local_files_only": True}
    max_memory = parse_max_memory(args.max_memory)
    config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    if max_memory:
        kwargs["max_memory"] = max_memory
    if args.offload_folder:
        kwargs["offload_folder"] = args.offload_folder
    if args.dtype:
        kwargs["dtype"] = args.dtype
    return _model_class(config).from_pretrained(checkpoint, **kwargs).eval()


def forward_once(model: Any) -> Dict[str, Any]:
    """One forward pass on a few random token ids, sent where the input embeddings compute."""
    import torch

    from metapatch.diagnose import _input_device

    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 32
    device = _input_device(model) or "cpu"
    ids = torch.randint(0, int(vocab), (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    started = time.perf_counter()
    try:
        with torch.no_grad():
            output = model(input_ids=ids)
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


def run(args: argparse.Namespace) -> int:
    import metapatch
    from metapatch.diagnose import diagnose

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
    if args.json:
        print(json.dumps({"loaded": True, "report": report.to_dict(), "forward": forward,
                          "hf_device_map": {k: str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()}},
                         indent=2))
    else:
        print(report)
        if forward is not None:
            if forward["ran"]:
                finite = "" if forward.get("finite", True) else " (NOT finite: some outputs are nan/inf)"
                print(f"  forward pass: ok in {forward['seconds']} s, output {forward.get('shape')} on "
                      f"{forward.get('device')}{finite}")
            else:
                print(f"  forward pass: FAILED: {forward['error_type']}: {forward['error']}")
    forward_ok = forward is None or (forward["ran"] and forward.get("finite", True))
    return 0 if report.ok and forward_ok else 1
