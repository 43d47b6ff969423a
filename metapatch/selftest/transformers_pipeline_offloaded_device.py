"""Reproducers for transformers-pipeline-offloaded-device: pipelines over models whose device map starts with
offload storage.

``Pipeline.__init__`` takes the device of the map's first entry. Where that entry is ``"disk"`` (``device_map=
"auto"`` with a ``max_memory`` nothing fits in gives ``{"": "disk"}``; an explicit map that offloads the
embedding) the pipeline cannot be built: ``RuntimeError: ... device type at start of device string: disk``.
Where it is ``"cpu"`` and the map has a GPU later, the pipeline sends its inputs to the CPU while accelerate
computes on the GPU. Fixed means: the pipeline's device is the dispatch's execution device (the map's first
accelerator where it has one, else the CPU: computed here from the map, as accelerate's ``dispatch_model``
decides it) and its output equals the in-memory pipeline's on that device, for text generation (the generated
token ids) and text classification (every label's score), with the model given by path or as a loaded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping

from ._device import main_device, memory_budget
from ._harness import Expect, Scenario
from ._models import save_tiny_llama

PATCH_ID = "transformers-pipeline-offloaded-device"
_TEXT = "w3 w17 w5 w99 w42 w8"
_NEW_TOKENS = 6
_SPECIALS = ("[UNK]", "<s>", "</s>")


def save_word_tokenizer(path: Path, vocab_size: int = 128) -> Path:
    """A word-level fast tokenizer ("w0".."wN" and three specials, ``vocab_size`` ids) saved in ``path``: the
    pipelines load it from the checkpoint's folder as they would a hub tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocab_size - len(_SPECIALS)
    vocab = {f"w{i}": i for i in range(words)}
    vocab.update({token: words + n for n, token in enumerate(_SPECIALS)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>",
                                        eos_token="</s>", pad_token="</s>")
    tokenizer.save_pretrained(path)
    return path


def _causal_checkpoint(workdir: Path) -> Path:
    path = save_tiny_llama(workdir / "ckpt", pad_token_id=127)
    return save_word_tokenizer(path)


def _classifier_checkpoint(workdir: Path) -> Path:
    import torch
    from transformers import LlamaForSequenceClassification

    from ._models import tiny_llama_config

    torch.manual_seed(0)
    path = workdir / "classifier"
    LlamaForSequenceClassification(tiny_llama_config(num_labels=3, pad_token_id=127)).eval().save_pretrained(path)
    return save_word_tokenizer(path)


def execution_device_of(device_map: Mapping[str, Any]) -> Any:
    """Where accelerate computes the offloaded modules of a model dispatched with ``device_map``
    (``dispatch_model``'s main device): its first accelerator, else the CPU."""
    import torch

    accelerators = [d for d in device_map.values() if str(d) not in ("cpu", "disk")]
    if not accelerators:
        return torch.device("cpu")
    first = accelerators[0]
    return torch.device(f"cuda:{first}") if isinstance(first, int) else torch.device(first)


def _memory(device_map: Dict[str, Any]) -> Dict[str, Any]:
    """``device_map`` with its "memory" entries on the execution device (GPU 0 where CUDA is present)."""
    return {name: main_device() if device == "memory" else device for name, device in device_map.items()}


def _generated_ids(pipe: Any) -> list:
    output = pipe(_TEXT, max_new_tokens=_NEW_TOKENS, min_new_tokens=_NEW_TOKENS, do_sample=False,
                  return_tensors=True)
    return [int(i) for i in output[0]["generated_token_ids"]]


def _scores(pipe: Any) -> Dict[str, float]:
    return {row["label"]: float(row["score"]) for row in pipe(_TEXT, top_k=None)}


def _offloaded_pipeline(task: str, source: Any, device_map: Any, workdir: Path, by: str, **model_kwargs: Any) -> Any:
    """``pipeline(task, ...)`` over the checkpoint at ``source`` dispatched with ``device_map``: built from the
    path (``by="path"``, the load inside ``pipeline``) or from a model loaded with ``from_pretrained`` first."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, pipeline

    offload = {"offload_folder": str(workdir / "offload"), **model_kwargs}
    if by == "path":
        return pipeline(task, model=str(source), device_map=device_map, model_kwargs=offload)
    auto = AutoModelForCausalLM if task == "text-generation" else AutoModelForSequenceClassification
    model = auto.from_pretrained(source, device_map=device_map, **offload).eval()
    return pipeline(task, model=model, tokenizer=AutoTokenizer.from_pretrained(source))


def _compare(task: str, source: Path, device_map: Any, workdir: Path, by: str, **model_kwargs: Any) -> Dict[str, Any]:
    """The pipeline over the offloaded model computes on the dispatch's execution device and answers as the
    in-memory pipeline on that device does; raises otherwise."""
    from transformers import pipeline

    pipe = _offloaded_pipeline(task, source, device_map, workdir, by, **model_kwargs)
    # a map of one device dispatches nothing and leaves no hf_device_map: the map asked for says where
    placed = dict(getattr(pipe.model, "hf_device_map", None) or device_map)
    expected = execution_device_of(placed)
    if pipe.device != expected:
        raise AssertionError(f"pipeline device {pipe.device} over the map {placed}; the dispatch computes on "
                             f"{expected}")
    reference = pipeline(task, model=str(source), device=expected)
    if task == "text-generation":
        got, want = _generated_ids(pipe), _generated_ids(reference)
        if got != want:
            raise AssertionError(f"generated ids over the map {placed}: {got} != in-memory {want}")
        diff = 0.0
    else:
        got, want = _scores(pipe), _scores(reference)
        if set(got) != set(want):
            raise AssertionError(f"labels {sorted(got)} != in-memory {sorted(want)}")
        diff = max(abs(got[label] - want[label]) for label in want)
    return {"max_abs_diff": diff, "pipeline_device": str(pipe.device), "device_map": {k: str(v) for k, v in placed.items()}}


def generation_nothing_fits(workdir: Path) -> Dict[str, Any]:
    """pipeline("text-generation", model=path, device_map="auto") with a max_memory nothing fits in: the map
    starts with disk (``{"": "disk"}`` on transformers 5.25); generated ids equal the in-memory pipeline's."""
    source = _causal_checkpoint(workdir)
    return _compare("text-generation", source, "auto", workdir, by="path", max_memory=memory_budget(1000))


def generation_root_on_disk(workdir: Path) -> Dict[str, Any]:
    """pipeline("text-generation", model=path, device_map={"": "disk"}): generated ids equal the in-memory
    pipeline's."""
    return _compare("text-generation", _causal_checkpoint(workdir), {"": "disk"}, workdir, by="path")


MIXED = {"model.embed_tokens": "disk", "model.rotary_emb": "memory", "model.layers.0": "memory",
         "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "memory", "model.norm": "cpu",
         "score": "memory"}


def classification_mixed_map(workdir: Path) -> Dict[str, Any]:
    """A LlamaForSequenceClassification loaded with from_pretrained over a map that starts with disk and mixes
    memory (GPU 0 where present), cpu and disk, then pipeline("text-classification", model=model): every
    label's score equals the in-memory pipeline's."""
    return _compare("text-classification", _classifier_checkpoint(workdir), _memory(MIXED), workdir, by="model")


CPU_FIRST = {"model.embed_tokens": "cpu", "model.rotary_emb": "memory", "model.layers": "memory",
             "model.norm": "memory", "score": "memory"}


def classification_cpu_first(workdir: Path) -> Dict[str, Any]:
    """The embedding on cpu, the rest in memory: on a GPU machine accelerate offloads the embedding and computes
    on GPU 0, where the pipeline must send its inputs (upstream: the CPU); on the CPU the map is one device and
    upstream's answer stands."""
    return _compare("text-classification", _classifier_checkpoint(workdir), _memory(CPU_FIRST), workdir,
                    by="path")


CPU_THEN_DISK = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                 "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu",
                 "lm_head": "disk"}


def unchanged_where_first_entry_computes(workdir: Path) -> Dict[str, Any]:
    """Upstream's device stands where the map's first entry is where the dispatch computes: all-cpu-then-disk
    (cpu, on every machine: no accelerator in the map), and a map that starts in memory (the execution device)
    with later layers on disk; both generate the in-memory pipeline's ids."""
    source = _causal_checkpoint(workdir)
    first = _compare("text-generation", source, CPU_THEN_DISK, workdir / "cpu-then-disk", by="model")
    second = _compare("text-generation", source, _memory({**CPU_THEN_DISK, "model.embed_tokens": "memory",
                                                          "lm_head": "memory"}), workdir / "memory-first",
                      by="path")
    return {"max_abs_diff": 0.0, "devices": [first["pipeline_device"], second["pipeline_device"]]}


_DISK_DEVICE = r"device type at start of device string: disk"
# A map with every module on disk is not usable upstream before transformers 5.13 (from_pretrained does not
# dispatch a map of one device: no hooks, no hf_device_map, every weight on meta, and the pipeline's
# model.to() fails; measured 5.7.0, 5.11.0) nor, from 5.13, before accelerate 1.15 (its dispatch refuses a
# whole model on disk; measured for tied-device-map-transformers, whose work-around keeps one small module on
# cpu and makes both load a disk-first map this patch then serves).
ALL_ON_DISK = (
    Expect("NotImplementedError", r"Cannot copy out of meta tensor", when={"transformers": "<5.13.0.dev0"}),
    Expect("ValueError", r"offload the whole model to the disk",
           when={"transformers": ">=5.13.0.dev0", "accelerate": "<1.15.0.dev0"}),
)

SCENARIOS = [
    Scenario(PATCH_ID, "text-generation-nothing-fits", f"{__name__}:generation_nothing_fits",
             'pipeline("text-generation", model=path, device_map="auto", model_kwargs={max_memory nothing fits in, '
             "offload_folder}): the map starts with disk; generated ids equal the in-memory pipeline's (unpatched: "
             "RuntimeError torch.device('disk'))",
             expected_error="RuntimeError", expected_message=_DISK_DEVICE, unpatched=ALL_ON_DISK, quick=True),
    Scenario(PATCH_ID, "text-generation-root-on-disk", f"{__name__}:generation_root_on_disk",
             'pipeline("text-generation", model=path, device_map={"": "disk"}): generated ids equal the in-memory '
             "pipeline's (unpatched: RuntimeError torch.device('disk'))",
             expected_error="RuntimeError", expected_message=_DISK_DEVICE, unpatched=ALL_ON_DISK),
    Scenario(PATCH_ID, "text-classification-mixed-map", f"{__name__}:classification_mixed_map",
             "a LlamaForSequenceClassification loaded over a disk-first map mixing memory, cpu and disk, given to "
             'pipeline("text-classification"): scores equal the in-memory pipeline\'s (unpatched: RuntimeError '
             "torch.device('disk'))",
             expected_error="RuntimeError", expected_message=_DISK_DEVICE),
    Scenario(PATCH_ID, "text-classification-cpu-first", f"{__name__}:classification_cpu_first",
             "the embedding on cpu, the rest in memory: the pipeline computes on GPU 0 where there is one "
             "(unpatched: it sends its inputs to the CPU); on a CPU machine nothing is offloaded and both agree",
             unpatched=(Expect(""), Expect("AssertionError", r"pipeline device cpu", devices=("cuda",))),
             in_selftest=False),
    Scenario(PATCH_ID, "unchanged-where-first-entry-computes", f"{__name__}:unchanged_where_first_entry_computes",
             "all-cpu-then-disk and memory-first maps keep upstream's pipeline device and generate the in-memory "
             "pipeline's ids (passes with and without metapatch)",
             unpatched=(Expect(""),), in_selftest=False),
]
