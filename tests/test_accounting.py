import pytest

from nlq_scale.config import load_run_config
from nlq_scale.model.accounting import count_parameters, flops_per_token
from tests.conftest import REPO, nlq

M = 1e6


def non_embedding(arm, *overrides):
    return count_parameters(load_run_config("124m", arm, overrides=list(overrides)).model).non_embedding


def test_124m_counts_match_the_papers():
    linear = non_embedding("linear")
    assert abs(linear / M - 84.95) <= 0.05
    assert abs(non_embedding("nonlinear") / linear - 1) < 1e-3
    assert abs(non_embedding("identity") / M - 77.88) <= 0.05
    control = non_embedding("linear", "model.mlp_ratio=4.75")
    assert abs(control / M - 95.6) <= 0.05 and abs(control / linear - 1.125) < 0.005


def test_nonlinear_adds_exactly_3d_per_layer_at_r_half_d():
    d, layers = 768, 12
    assert non_embedding("nonlinear") - non_embedding("linear") == 3 * d * layers


def test_without_norm_bias_nonlinear_adds_2d_and_residual_adds_nothing():
    d, layers = 768, 12
    assert non_embedding("nonlinear", "model.norm_bias=false") - non_embedding("linear", "model.norm_bias=false") == 2 * d * layers
    assert non_embedding("residual") == non_embedding("linear")
    # 2 block LayerNorms per layer + the final one lose their biases
    assert non_embedding("linear") - non_embedding("linear", "model.norm_bias=false") == (2 * layers + 1) * d


def test_qk_norm_kinds():
    dk, layers = 64, 12
    assert non_embedding("nonlinear", "model.qk_norm=learned") - non_embedding("nonlinear") == layers * 2 * 2 * dk
    assert non_embedding("identity", "model.qk_norm=rms") == non_embedding("identity")


def test_matched_control_is_within_one_mlp_unit_of_its_target():
    target = non_embedding("nonlinear")
    matched = non_embedding("linear-matched")
    assert abs(matched - target) <= 12 * 2 * 768 / 2


def test_flops_per_token_follows_6n_plus_attention():
    m = load_run_config("124m", "linear").model
    n = count_parameters(m).non_embedding + m.padded_vocab_size * m.hidden_size
    assert flops_per_token(m) == 6 * n + 12 * 12 * 1024 * 768


def test_moe_counts_active_experts_only():
    m = load_run_config("124m", "linear", overrides=["model.moe.num_experts=8", "model.moe.router_topk=2"]).model
    c = count_parameters(m)
    dense = count_parameters(load_run_config("124m", "linear").model)
    mlp = 2 * 768 * 3072
    assert c.non_embedding - dense.non_embedding == 12 * (7 * mlp + 768 * 8)
    assert c.active_non_embedding == c.non_embedding - 12 * 6 * mlp


def test_params_cli_json():
    import json

    r = nlq("params", "--scale", "124m", "--arm", "linear", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert abs(info["params"]["non_embedding"] / M - 84.95) <= 0.05 and info["flops_per_token"] > 0


def test_the_roofline_prices_the_query_path_and_its_table_is_the_documented_one():
    """On paper (nlq_scale/model/roofline.py): the nonlinear query's memory-bound passes cost
    less of a step as the model widens; identity, with no W_Q, is the fastest arm; the table in
    docs/performance.md is what the module prints."""
    from nlq_scale.model.roofline import seconds_per_token, table

    def speed_over_linear(scale: str, arm: str) -> float:
        linear = seconds_per_token(load_run_config(scale, "linear").model)
        return linear / seconds_per_token(load_run_config(scale, arm).model)

    ratios = [speed_over_linear(s, "nonlinear") for s in ("124m", "1.3b", "13b")]
    assert ratios == sorted(ratios) and 0.9 < ratios[0] < ratios[-1] < 1.0
    assert speed_over_linear("124m", "identity") > 1.0
    assert table() in (REPO / "docs" / "performance.md").read_text(), "run: python -m nlq_scale.model.roofline"
