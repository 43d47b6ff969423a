"""metapatch sweep: the CI sample (metapatch.sweep.SAMPLE, 6 architectures x 4 placements and 4 flows, both
legs, 80-130 s with two jobs on a loaded 2-core machine), plus the pure parts (placements of real module trees, the counts of the table)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metapatch import sweep
from metapatch.sweep import render

REPO = Path(__file__).resolve().parents[1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


def test_sample_sweep(tmp_path):
    docs = REPO / "docs" / "sweep.md"
    before = _digest(docs)
    env = dict(os.environ, METAPATCH_SWEEP_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    env.pop("METAPATCH_DISABLE", None)
    command = [sys.executable, "-m", "metapatch", "sweep", "--sample", "--jobs", "2"]  # writes nothing unless asked
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    (stack_dir,) = (tmp_path / "cache").iterdir()
    results = {}
    for arch in sweep.SAMPLE:
        for leg in sweep.LEGS:
            results[(arch, leg)] = json.loads((stack_dir / f"{arch}.{leg}.json").read_text())
    archs = [(a, "") for a in sweep.SAMPLE]
    summary = render.summarize(archs, results)
    assert not summary["broken"], summary["broken"]  # every sample architecture builds and runs in memory
    counts = summary["counts"]
    assert counts["regressions"] == 0 and counts.get("wrong_patched", 0) == 0, counts
    assert counts["ok_patched"] == counts["cells"], [
        (a, name, row) for (a, leg), r in results.items() if leg == "patched"
        for name, row in r["placements"].items() if row["status"] not in ("ok", "n/a")]
    assert counts["ok_upstream"] < counts["cells"]  # the sample does meet the bugs upstream
    assert render.counts_line(summary) in run.stdout
    # The flows ran on every sample architecture (none skipped as n/a), none wrong or refused with metapatch.
    flow_rows = {(arch, name): results[(arch, "patched")]["flows"][name] for arch in sweep.SAMPLE for name in render.FLOWS}
    assert all(row["status"] == "ok" for row in flow_rows.values()), {
        key: row for key, row in flow_rows.items() if row["status"] != "ok"}
    assert counts["flow_cells"] == len(sweep.SAMPLE) * len(render.FLOWS) == counts["flow_ok_patched"], counts
    assert counts.get("flow_regressions", 0) == counts.get("flow_wrong_patched", 0) == 0, counts
    assert counts["flow_ok_upstream"] < counts["flow_cells"]  # and the flows' bugs upstream
    # T5's float16 wo (_keep_in_fp32_modules) on disk: float16 upstream, float32 as in memory with metapatch
    t5 = results[("T5ForConditionalGeneration", "unpatched")]["flows"]["float16"]
    assert t5["status"] == "wrong" and "wo.weight is torch.float16" in t5["detail"], t5
    assert render.flows_line(summary) in run.stdout
    for (arch, leg), result in results.items():  # the same model in both legs
        assert result["reference_sha"] == results[(arch, "unpatched")]["reference_sha"], arch
    assert _digest(docs) == before and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert f"{2 * len(sweep.SAMPLE)} cached, 0 to run" in again.stderr, again.stderr


def _leg(placements, flows=None, **extra):
    return {"placements": {name: {"status": status} for name, status in placements.items()},
            "flows": {name: {"status": status} for name, status in (flows or {}).items()}, "wall_s": 1.0, **extra}


def test_counts_of_the_table():
    names = render.PLACEMENTS
    results = {
        ("A", "unpatched"): _leg(dict(zip(names, ["error", "ok", "ok", "n/a"]))),
        ("A", "patched"): _leg(dict(zip(names, ["ok", "ok", "wrong", "n/a"]))),
        ("B", "unpatched"): _leg({}, build={"type": "ValueError", "message": "bad config", "where": "x.py:1"}),
        ("B", "patched"): _leg({}, build={"type": "ValueError", "message": "bad config", "where": "x.py:1"}),
        ("C", "unpatched"): None, ("C", "patched"): None,
    }
    results[("A", "patched")]["placements"][names[0]]["metapatch"] = False
    summary = render.summarize([("A", ""), ("B", ""), ("C", "")], results)
    assert summary["runnable"] == ["A"] and summary["missing"] == ["C"]
    assert summary["broken"] == [("B", "build: ValueError: bad config (x.py:1)")]
    c = summary["counts"]
    assert (c["cells"], c["n/a"], c["ok_upstream"], c["ok_patched"]) == (3, 1, 2, 2)
    assert c["regressions"] == 1 and c["wrong_patched"] == 1
    assert render.counts_line(summary).startswith("1 architectures x 4 placements (3 applicable cells): 2 work upstream, 2")
    text = render.markdown([("A", ""), ("B", ""), ("C", "")], results, {"transformers": "x"}, "metapatch sweep", 2.0)
    # bold: not ok with metapatch; flows this leg did not measure: -
    assert "| A | fail / ok | ok / ok | **ok / WRONG** | n/a / n/a | - / - | - / - | - / - | - / - | 2 |" in text
    assert c["flow_missing"] == len(render.FLOWS) and "flow_cells" not in c


def test_flow_cells_are_counted_and_shown():
    names, flows = render.PLACEMENTS, render.FLOWS
    unpatched = _leg(dict.fromkeys(names, "ok"), dict(zip(flows, ["wrong", "error", "n/a", "ok"])))
    patched = _leg(dict.fromkeys(names, "ok"), dict(zip(flows, ["ok", "ok", "n/a", "error"])))
    unpatched["flows"][flows[2]]["detail"] = patched["flows"][flows[2]]["detail"] = "in memory: ValueError: x"
    results = {("A", "unpatched"): unpatched, ("A", "patched"): patched}
    summary = render.summarize([("A", "")], results)
    c = summary["counts"]
    assert (c["flow_cells"], c["flow_n/a"], c["flow_ok_upstream"], c["flow_ok_patched"]) == (3, 1, 1, 2)
    assert c["flow_wrong_upstream"] == 1 and c["flow_regressions"] == 1 and render.regressions(summary) == 1
    text = render.markdown([("A", "")], results, {"transformers": "x"}, "metapatch sweep", 2.0)
    assert "| A | ok / ok | ok / ok | ok / ok | ok / ok | WRONG / ok | fail / ok | n/a / n/a | **ok / fail** | 2 |" in text
    assert f"- 1 x `{flows[2]}`: in memory: ValueError: x: A" in text
    assert "3 applicable cells, 1 work upstream, 2 with metapatch; 1 n/a" in render.flows_line(summary)


def test_placements_of_real_module_trees():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from metapatch.sweep import placements, shrink

    with torch.device("meta"):
        t5 = transformers.T5ForConditionalGeneration(shrink.tiny_config(transformers.T5Config))
    top, layer_lists = placements.units(t5)
    assert [len(x) for x in layer_lists] == [2, 2] and layer_lists[0][0] == "encoder.block.0"
    assert top[0] == "shared" and "lm_head" in top
    first = placements.device_map("first-on-disk", top, layer_lists, "cpu")
    assert first["shared"] == "disk" and list(first.values()).count("disk") == 1
    alternate = placements.device_map("alternate-layers-on-disk", top, layer_lists, "cpu")
    assert [k for k, v in alternate.items() if v == "disk"] == ["encoder.block.1", "decoder.block.1"]
    covered = set(first)
    assert all(any(n == k or n.startswith(k + ".") for k in covered) for n, _ in t5.named_parameters())


def test_generation_defaults_on_a_4x_config_are_not_shrunk(monkeypatch):
    """transformers 4.x keeps generate()'s defaults on every config (top_k=50): shrunk to 2 by the MoE rule
    beside do_sample=False, save_pretrained refused every 4.57 architecture ("GenerationConfig is invalid").
    A generation default keeps its default value; the same key holding another value (an MoE's top_k)
    is still shrunk."""
    transformers = pytest.importorskip("transformers")
    from metapatch.sweep import shrink

    monkeypatch.setattr(transformers.PretrainedConfig, "_get_global_generation_defaults",
                        staticmethod(lambda: {"top_k": 50, "num_beams": 1}), raising=False)
    assert shrink.shrink_dict({"top_k": 50, "hidden_size": 4096})["top_k"] == 50
    assert shrink.shrink_dict({"top_k": 8})["top_k"] == 2
    assert shrink.shrink_dict({"text_config": {"top_k": 50, "model_type": "x"}})["text_config"]["top_k"] == 50


@pytest.mark.parametrize("class_name, model_type", [("DeepseekV3ForCausalLM", "deepseek_v3"), ("GPTJForCausalLM", "gptj"),
                                                       ("Gemma4ForCausalLM", "gemma4_text")])
def test_shrunk_configs_that_used_to_fail_in_memory_build_and_run(class_name, model_type):
    """DeepSeek-V3 (latent attention: as many key/value heads as heads; qk_head_dim derived from the nope
    and rope head dims) and GPT-J (rotary_dim above the shrunk head dim) were listed "cannot build" on
    5.17 and 4.57, Gemma 4 on 5.24 (its per-layer embedding's vocab_size_per_layer_input shrunk to 8, the
    size of hidden_size_per_layer_input: token ids past 8 indexed out of range): their shrunk configs now
    build and run in memory."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers import CONFIG_MAPPING

    from metapatch.sweep import shrink

    if not hasattr(transformers, class_name) or model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    config = shrink.tiny_config(CONFIG_MAPPING[model_type])
    model = getattr(transformers, class_name)(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    with torch.no_grad():
        logits = model(torch.randint(0, 100, (1, 8))).logits
    assert logits.shape[:2] == (1, 8) and torch.isfinite(logits).all()


def _assert_builds_small_and_generates(class_name, config):
    """The tiny model of ``config`` is under the sweep's size limit and generates 3 greedy tokens in memory."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    ids = torch.randint(4, 200, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11)


@pytest.mark.parametrize("class_name", [
    "DeepseekV2ForCausalLM",  # num_experts_per_tok None by default
    "MinistralForCausalLM", "HunYuanDenseV1ForCausalLM", "NemotronForCausalLM",  # head_dim / key-value heads None
    "Ernie4_5_MoeForCausalLM", "KimiLinearForCausalLM",  # top-k named moe_k / num_experts_per_token: 6 and 8 of 4
    "Mamba2ForCausalLM", "FalconH1ForCausalLM",  # heads x head dim = expand x hidden, validated
    "BambaForCausalLM",  # attention layers listed by index, none by default: all Mamba, no cache to mask
    "XLMWithLMHeadModel",  # emb_dim: 100M parameters
])
def test_default_configs_that_leave_sizes_unset_or_tied_shrink_to_models_that_generate(class_name):
    """Listed "do not build or run in memory" in docs/sweep.md on 5.25: default configs that leave a size the
    model needs unset (None), or whose sizes are tied (a Mamba-2 mixer's), or a size attribute the rules did not
    know. Each now builds under the size limit and generates in memory."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers import CONFIG_MAPPING

    from metapatch.sweep import shrink

    if not hasattr(transformers, class_name):
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    config = shrink.tiny_config(CONFIG_MAPPING[dict(sweep.architectures())[class_name]])
    _assert_builds_small_and_generates(class_name, config)


def test_a_shrinking_rule_reruns_only_the_architectures_whose_config_it_changes(monkeypatch):
    pytest.importorskip("transformers")
    import re

    from metapatch.sweep import shrink

    stamp = sweep.cache_keys()
    before = {mt: sweep.arch_keys(stamp, mt) for mt in ("llama", "gpt2", "t5")}
    assert before == {mt: sweep.arch_keys(stamp, mt) for mt in before}  # a key is a function of the config
    assert len({keys["unpatched"] for keys in before.values()}) == 3
    assert all(keys["patched"].startswith(keys["unpatched"] + "-") for keys in before.values())
    # A rule for an attribute only GPT-2's config has (n_positions), ahead of the others.
    monkeypatch.setattr(shrink, "_COMPILED", [(re.compile(r"^n_positions$"), 96), *shrink._COMPILED])
    after = {mt: sweep.arch_keys(stamp, mt) for mt in before}
    assert after["gpt2"] != before["gpt2"]
    assert after["llama"] == before["llama"] and after["t5"] == before["t5"]


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "docs").glob("sweep*.md")))
def test_committed_sweep_tables_are_whole(name):
    """Each committed table lists every architecture its counts name (docs/sweep.md was once committed cut
    off at 40960 bytes, mid-list, when the disk filled up during a write)."""
    import re

    text = (REPO / "docs" / name).read_text()
    assert text.endswith("\n")
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| architecture", "|---"))]
    header = re.search(r"\*\*(\d+) architectures x 4 placements", text)
    assert header and len(table) == int(header.group(1)), (name, len(table))
    broken = re.search(r"## Architectures that do not build or run in memory \((\d+)\)\n\n.*?\n\n((?:- .*\n)*)", text)
    assert broken, name
    assert len(broken.group(2).splitlines()) == int(broken.group(1)), name


@pytest.mark.parametrize("class_name", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "JambaForCausalLM",
                                        "BailingHybridForCausalLM"])
def test_hybrids_keep_one_layer_of_each_kind_and_generate(class_name):
    """Shrunk to two layers by the layer-count rule alone, a linear/full-attention hybrid came out all linear
    attention and generate() failed in memory (``get_seq_length can only be called on Attention layers``):
    Qwen3-Next, Qwen3.5 (also built from its composite config before: no ``vocab_size``), Jamba and
    Bailing-Hybrid were listed as not building. Each now keeps one layer of each kind and generates."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers import CONFIG_MAPPING

    from metapatch.sweep import shrink

    if not hasattr(transformers, class_name):
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    model_type = dict(sweep.architectures())[class_name]
    default_kinds = set(getattr(CONFIG_MAPPING[model_type](), "layer_types", None) or ())
    config = shrink.tiny_config(CONFIG_MAPPING[model_type])
    kinds = getattr(config, "layer_types", None) or ()
    if default_kinds:  # (Jamba on 4.57 derives its kinds from attn_layer_period/offset alone)
        assert len(set(kinds)) == len(default_kinds) > 1, (kinds, default_kinds)
    _assert_builds_small_and_generates(class_name, config)


def test_each_class_is_swept_with_its_own_config_class():
    """A class mapped from several model types is built from the one whose config class is its own:
    LlamaForCausalLM was swept with Exaone's config (the first type mapped to it), Qwen3.5's and Llama 4's
    causal LMs with their composite configs, which they cannot be built from."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    chosen = dict(sweep.architectures())
    assert chosen["LlamaForCausalLM"] == "llama"
    for name in ("Qwen3_5ForCausalLM", "Llama4ForCausalLM"):
        if name in chosen:
            assert CONFIG_MAPPING_NAMES[chosen[name]] == getattr(transformers, name).config_class.__name__
