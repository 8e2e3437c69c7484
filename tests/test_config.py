import ast
import subprocess
import sys
from importlib.util import resolve_name
from pathlib import Path

import pytest
import yaml

from nlq_scale.config import available, load_run_config, parse_overrides
from nlq_scale.errors import UsageError
from tests.conftest import REPO, nlq

# The layers under the config, lowest first: the schema derives model.arm from the arm registry and
# solves a matched MLP width with the accounting, so nothing below it may import what sits above.
CONFIG_LAYERS = ("nlq_scale.shape", "nlq_scale.arms", "nlq_scale.model.accounting", "nlq_scale.config.schema")


def test_layers_scale_arm_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train: {lr: 1.0e-3, steps: 7}\nmodel: {mlp_ratio: 4.5}\n")
    cfg = load_run_config("124m", "nonlinear", path, ["train.steps=9", "model.nlq.activation=silu"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.arm) == (12, 768, "nonlinear")
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 9 and cfg.model.mlp_ratio == 4.5
    assert cfg.model.nlq.activation == "silu" and cfg.variant == "nonlinear" and cfg.scale == "124m"


def test_override_values_are_yaml_scalars():
    assert parse_overrides(["a.b=1", "a.c=1e-3", "d=true", "e=[1, 2]", "f=x"]) == {
        "a": {"b": 1, "c": 1e-3},
        "d": True,
        "e": [1, 2],
        "f": "x",
    }


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.foo=1"], "model.foo: unknown key"),
        (["model.num_layers=x"], "model.num_layers"),
        (["parallel.tp=5"], "not divisible by parallel.tp"),
        (["model.num_query_groups=5"], "num_query_groups (5) must divide"),
        (["parallel.pp=5"], "num_layers (12) not divisible by parallel.pp"),
        (["model.kv_channels=32"], "query width == hidden_size"),
        (["train.warmup_steps=5000", "train.steps=10"], "warmup_steps"),
        (["checkpoint.async_save=true", "train.engine=deepspeed"], "checkpoint.async_save needs train.engine=megatron"),
        (["bad"], "expected key.path=value"),
        (["logging.profile_steps=[5]"], "logging.profile_steps"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(overrides, message):
    with pytest.raises(UsageError) as err:
        load_run_config("124m", "identity", overrides=overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_scale_and_malformed_yaml(tmp_path):
    with pytest.raises(UsageError, match="unknown scale 'nope'"):
        load_run_config("nope", "linear")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_layers: [1,\n")
    with pytest.raises(UsageError, match="bad.yaml: line .* malformed YAML"):
        load_run_config(config_path=bad)


def test_ladder_and_arms_exist():
    scales = set(available("scales"))
    assert {"124m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "175b", "cpu-xs", "cpu-s", "cpu-m"} <= scales
    assert {"linear", "identity", "nonlinear", "preproj", "linear-mlp4.75", "linear-matched"} <= set(available("arms"))
    for scale in scales:
        for arm in ("linear", "nonlinear", "identity"):
            load_run_config(scale, arm)  # every rung admits every arm


def test_cli_bad_input_exits_2_with_one_line():
    r = nlq("params", "--scale", "124m", "--arm", "identity", "model.num_attention_heads=7")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "query width == hidden_size" in r.stderr
    r = nlq("params", "--scale", "124m")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--arm" in r.stderr


def test_matched_mlp_width_is_solved_once_at_load_and_kept(tmp_path):
    """match_params_of becomes a concrete model.ffn_hidden_size when the config is loaded; the saved
    config carries it, reloads to the same width, and a run saved before the field existed resumes."""
    from nlq_scale.config.load import build_run_config, dump_run_config
    from nlq_scale.model.accounting import count_parameters
    from nlq_scale.train.rundir import claim

    cfg = load_run_config("cpu-s", "linear-matched")
    width = cfg.model.ffn_hidden_size
    assert width and width != round(cfg.model.mlp_ratio * cfg.model.hidden_size)
    target = count_parameters(load_run_config("cpu-s", cfg.model.match_params_of).model).non_embedding
    assert abs(count_parameters(cfg.model).non_embedding - target) <= cfg.model.num_layers * 2 * cfg.model.hidden_size
    saved = yaml.safe_load(dump_run_config(cfg))
    assert saved["model"]["ffn_hidden_size"] == width
    assert build_run_config(saved).model.ffn_hidden_size == width
    saved["model"]["ffn_hidden_size"] = width + 1
    with pytest.raises(UsageError, match=r"model: ffn_hidden_size=\d+ does not match the parameters of"):
        build_run_config(saved)

    run = tmp_path / "run"
    run.mkdir()
    saved["model"].pop("ffn_hidden_size")  # as an earlier version wrote it
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert claim(run, cfg) is True


def test_validation_sizes_in_tokens_are_solved_once_into_sequences():
    """data.val_tokens and a named set's tokens become whole 16-sequence blocks of model.seq_length
    (64 at cpu-xs) when the config loads, over the scale's own val_sequences; names are unique."""
    from nlq_scale.config.load import build_run_config, dump_run_config

    cfg = load_run_config("cpu-xs", overrides=[
        "data.val_tokens=1025", "data.validation=[{name: pile-arxiv, path: /d, tokens: 1024}, {name: b, path: /e, sequences: 3}]",
    ])  # fmt: skip
    assert cfg.data.val_sequences == 32  # 1025 tokens > 16 sequences of 64: two blocks
    assert [v.sequences for v in cfg.data.validation] == [16, 3]
    assert [metric for metric, _, _ in cfg.data.val_sets()] == ["val/loss", "val/pile-arxiv/loss", "val/b/loss"]
    assert build_run_config(yaml.safe_load(dump_run_config(cfg))) == cfg
    for bad, message in (
        (["data.validation=[{name: a, path: /d}]"], r"data.validation\[0\] \(a\): give tokens or sequences"),
        (["data.validation=[{name: a, path: /d, sequences: 1}, {name: a, path: /e, sequences: 1}]"], "names must differ"),
        (["data.validation=[{name: a/b, path: /d, sequences: 1}]"], "data.validation.0.name"),
    ):
        with pytest.raises(UsageError, match=message):
            load_run_config("cpu-xs", overrides=bad)


def test_shipped_gpu_scales_validate_on_enough_tokens_for_a_0_005_nat_standard_error():
    """docs/training.md: at the assumed 0.45-nat spread of per-sequence losses, SE = 0.45/sqrt(n) < 0.005."""
    for scale in ("124m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "175b"):
        n = load_run_config(scale).data.val_sequences
        assert 0.45 / n**0.5 < 0.005, (scale, n)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> set[str]:
    """The package's modules an import statement loads: `from a import b` loads a.b when it is one."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & modules
    base = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names} & modules


def package_imports() -> dict[str, set[str]]:
    """Every nlq_scale module -> the nlq_scale modules it imports anywhere: at the top, under
    TYPE_CHECKING or inside a function (an import deferred to dodge a cycle still closes it). The
    registry's import_module of each shipped arm is no import statement, so it is not an edge."""
    paths = {module_name(p): p for p in (REPO / "nlq_scale").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        nodes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)]
        graph[name] = set().union(*(imported_modules(n, package, set(paths)) for n in nodes)) - {name}
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """An import path from start back to start, or None."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop()
        for after in sorted(graph.get(path[-1], ())):
            if after == start:
                return [*path, start]
            if after not in seen:
                seen.add(after)
                paths.append([*path, after])
    return None


def test_no_import_cycle_in_the_package():
    """Not through the config layers, nor through the arms and the reference model (whose shared MLP
    and epsilon live in model/query.py)."""
    graph = package_imports()
    cycles = [" -> ".join(c) for c in (cycle_through(graph, m) for m in sorted(graph)) if c]
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("layer", CONFIG_LAYERS)
def test_each_config_layer_imports_first_without_the_layers_above(layer):
    above = CONFIG_LAYERS[CONFIG_LAYERS.index(layer) + 1 :]
    code = f"import sys, {layer}; print([m for m in {above!r} if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"importing {layer} loads {r.stdout.strip()}"


def test_model_config_has_every_field_the_arms_and_accounting_read():
    from nlq_scale.config.schema import ModelConfig
    from nlq_scale.shape import ModelShape

    assert isinstance(ModelConfig(), ModelShape)
