"""model.core_attention=sdpa: megatron's attention through torch's scaled_dot_product_attention gives
the loss, the gradients and the generated tokens of megatron's own (unfused) core attention, for
every arm, and really runs SDPA (a fallback to megatron's forward would pass the comparisons too)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from nlq_scale import arms
from nlq_scale.errors import UsageError
from nlq_scale.model import core_attention
from nlq_scale.model.core_attention import SDPAttention
from tests.test_arms import _loss_and_gradients, case_config
from tests.test_model import build_model

SHAPES = {
    "stock": [],
    "gqa-rope-learnedqk": ["model.num_query_groups=2", "model.position_embedding=rope", "model.qk_norm=learned"],
    "mup-selective": ["model.parametrization=mup", "model.mup_base_hidden_size=16", "model.mup_base_head_dim=8",
                      "parallel.recompute=selective"],  # fmt: skip
}


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The query lengths of every SDPA call the core attention makes."""
    calls, sdpa = [], core_attention.F.scaled_dot_product_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(core_attention.F, "scaled_dot_product_attention", counted)
    return calls


def _core_attentions(model) -> set[type]:
    return {type(m) for name, m in model.named_modules() if name.endswith("core_attention")}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("arm", arms.names())
def test_sdpa_gives_megatron_attentions_loss_and_gradients(single_rank, sdpa_calls, arm, shape):
    overrides = SHAPES[shape]
    stock, sdpa = (case_config(arm, [*overrides, f"model.core_attention={c}"]) for c in ("stock", "sdpa"))
    assert _core_attentions(build_model(stock)) == {DotProductAttention}
    assert _core_attentions(build_model(sdpa)) == {SDPAttention}
    expected = _loss_and_gradients(stock)
    assert not sdpa_calls
    got = _loss_and_gradients(sdpa)
    runs = 2 if sdpa.parallel.recompute == "selective" else 1  # selective recompute reruns it in backward
    assert sdpa_calls == [sdpa.model.seq_length] * sdpa.model.num_layers * runs
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arm", [arms.baseline().name, "nonlinear"])
def test_sdpa_generates_megatron_attentions_tokens_from_the_kv_cache(single_rank, sdpa_calls, arm):
    from nlq_scale.data.tokenizer import EOT_ID
    from nlq_scale.export.generate import decode_harness

    prompt = [11, 22, 33, 44, 55]
    stock, sdpa = (case_config(arm, ["model.num_query_groups=2", f"model.core_attention={c}"]) for c in ("stock", "sdpa"))
    expected = decode_harness(build_model(stock).eval(), prompt, 12, EOT_ID)
    got = decode_harness(build_model(sdpa).eval(), prompt, 12, EOT_ID)
    assert got == expected
    layers = sdpa.model.num_layers
    assert sdpa_calls == [len(prompt)] * layers + [1] * layers * (len(got) - 1)  # the prompt, then one token at a time


def test_sdpa_is_refused_with_transformer_engine():
    with pytest.raises(UsageError, match="core_attention=sdpa needs transformer_impl=local"):
        case_config("linear", ["model.core_attention=sdpa", "model.transformer_impl=transformer_engine"])


def test_auto_resolves_once_to_sdpa_with_the_local_spec_and_to_transformer_engines_own():
    assert case_config("linear", []).model.core_attention == "sdpa"
    assert case_config("linear", ["model.transformer_impl=transformer_engine"]).model.core_attention == "stock"
    assert case_config("linear", ["model.core_attention=default"]).model.core_attention == "stock"  # its old name


def test_a_run_saved_before_core_attention_existed_resumes_with_the_change_recorded(tmp_path):
    import json

    import yaml

    from nlq_scale.train import rundir

    cfg = case_config("linear", [])
    rundir.claim(tmp_path, cfg)
    old = yaml.safe_load((tmp_path / rundir.CONFIG_FILE).read_text())
    del old["model"]["core_attention"]
    (tmp_path / rundir.CONFIG_FILE).write_text(yaml.safe_dump(old, sort_keys=False))
    assert rundir.read_config(tmp_path).model.core_attention == "stock"  # megatron's attention trained it
    assert rundir.claim(tmp_path, cfg)
    change = json.loads((tmp_path / rundir.CHANGES_FILE).read_text().splitlines()[-1])
    assert change["changes"] == {"model.core_attention": ["stock", "sdpa"]}
    assert rundir.read_config(tmp_path).model.core_attention == "sdpa"
