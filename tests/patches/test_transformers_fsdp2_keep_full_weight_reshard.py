"""transformers-fsdp2-keep-full-weight-reshard: three-way proof on two real ranks (gloo on CPU) with
transformers' own FSDP2 loading (``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``):
an evaluation forward, an optimizer built from ``model.parameters()``, one SGD step. Unpatched every
rank's optimizer holds unsharded copies and the step differs from one process; patched every rank
equals it (tolerance 1e-5, measured 0.0); the transformers diff alone too. Plus an in-process check
that a model loaded without ``distributed_config`` never gets the hook."""

from __future__ import annotations

import pytest

from metapatch.patches.transformers_fsdp2_keep_full_weight_reshard import _HOOKED, PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


@pytest.mark.ranks
@pytest.mark.slow
class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"eval-then-train-llama", "eval-then-train-tied-qwen2"}}

    def check_unpatched(self, scenario, outcome):
        if outcome.passed:
            return
        # loading is right on both ranks; the optimizer got unsharded tensors, and the step is what differs
        for rank in (0, 1):
            assert f"'rank{rank}_loaded_diff': 0.0" in outcome.error, outcome.error
            assert f"'rank{rank}_unsharded': 0," not in outcome.error, outcome.error
            assert f"'rank{rank}_stepped_diff': 0.0" not in outcome.error, outcome.error

    def check_patched(self, scenario, outcome):
        assert outcome.metrics["step_change"] > 0, outcome.metrics
        assert outcome.metrics["rank0_unsharded"] == outcome.metrics["rank1_unsharded"] == 0, outcome.metrics

    check_diff = check_patched


def test_plain_load_gets_no_hook(tmp_path):
    """Where nothing is distributed the wrapped function is never reached: no hook, upstream's model."""
    pytest.importorskip("transformers")
    import metapatch  # noqa: F401 - active in this process
    from transformers import AutoModelForCausalLM

    from metapatch.selftest._models import save_tiny_llama

    save_tiny_llama(tmp_path / "ckpt", num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert not getattr(model, _HOOKED, False)
    assert not model._forward_hooks
