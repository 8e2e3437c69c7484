"""Export to transformers and generation: for every registered arm the exported model's logits and
greedy tokens equal the harness's; checkpoints from a TP=2 megatron run and ZeRO-3 DeepSpeed runs (at
DP=2 and at TP=2) export to models whose validation loss is the one the training ranks logged; bad
input is refused."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from nlq_scale import arms
from nlq_scale.config import load_run_config
from tests.conftest import REPO, TINY_MODEL, cli, nlq, read_metrics, refused
from tests.test_model import build_model

TOL = 1e-4
CASES = [pytest.param(arm, [], id=arm) for arm in arms.names()] + [
    pytest.param(arm, ["model.position_embedding=rope", "model.normalization=RMSNorm", "model.num_query_groups=2",
                       "model.add_bias_linear=true", "model.tie_embeddings=false"], id=f"{arm}-rope-rms-gqa-bias")
    for arm in arms.names()
] + [
    pytest.param(arm, ["model.qk_norm=learned", "model.norm_bias=false"], id=f"{arm}-learnedqk-nobias")
    for arm in arms.names()
] + [pytest.param(arms.baseline().name, ["model.qk_norm=rms"], id="baseline-rmsqk")] + [
    # muP: the logit multiplier travels in the exported config (the baseline then needs our modeling code)
    pytest.param(arm, ["model.parametrization=mup", "model.mup_base_hidden_size=16", "model.mup_base_head_dim=8"],
                 id=f"{arm}-mup")
    for arm in (arms.baseline().name, "nonlinear")
] + [
    # MoE: megatron's top-k router and experts in the exported modeling code (no stock class fits)
    pytest.param(arm, ["model.moe.num_experts=4", "model.moe.router_topk=2"], id=f"{arm}-moe")
    for arm in (arms.baseline().name, "nonlinear")
]  # fmt: skip


def config(arm: str, overrides: list[str]):
    return load_run_config("124m", overrides=[*TINY_MODEL, f"model.arm={arm}", *overrides])


def harness(cfg, seed: int = 3) -> torch.nn.Module:
    """A tiny megatron GPT with every parameter random (norm gains and biases too, so a norm or
    bias mapped to the wrong place shows)."""
    model = build_model(cfg, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def harness_logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1), None)


def tokens_for(cfg, batch: int = 2):
    return torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_length), generator=torch.Generator().manual_seed(1))


def exported(model, cfg, out: Path):
    """Written with the exporter and loaded back as any transformers user would."""
    from transformers import AutoModelForCausalLM

    from nlq_scale.export.hf import hf_model, write_export

    write_export(hf_model(model.state_dict(), cfg.model), out, cfg.model, {"test": True})
    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("arm, overrides", CASES)
def test_export_logits_and_greedy_tokens_equal_the_harness(single_rank, tmp_path, arm, overrides):
    from nlq_scale.data.tokenizer import EOT_ID
    from nlq_scale.export.generate import decode_harness

    cfg = config(arm, overrides)
    model = harness(cfg)
    if arms.get(arm).export_query(cfg.model) is None:  # an arm (e.g. a plugin) that declares no export
        from nlq_scale.errors import UsageError
        from nlq_scale.export.hf import hf_model

        with pytest.raises(UsageError, match="export_query"):
            hf_model(model.state_dict(), cfg.model)
        return
    hf = exported(model, cfg, tmp_path / "export")
    tokens = tokens_for(cfg)
    ours, theirs = harness_logits(model, tokens), hf(tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= TOL

    prompt = tokens[0, :5].tolist()
    new = decode_harness(model, prompt, 12, EOT_ID)
    assert new == greedy_recomputing_the_prefix(model, prompt, 12, EOT_ID)  # the KV cache changes nothing
    lengths = []  # tokens per forward call: the prompt, then one at a time (a KV cache)
    hook = hf.register_forward_pre_hook(lambda _m, _a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=EOT_ID)
    hook.remove()
    assert out[0, 5:].tolist() == new
    assert lengths == [5] + [1] * (len(new) - 1)


def greedy_recomputing_the_prefix(model, prompt: list[int], max_new_tokens: int, eot: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(harness_logits(model, torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] == eot:
            break
    return ids[len(prompt):]


def test_sampling_is_seeded_and_top_1_is_greedy(single_rank):
    from nlq_scale.data.tokenizer import EOT_ID
    from nlq_scale.export.generate import Sampling, decode_harness

    cfg = config(arms.baseline().name, [])
    model, prompt = harness(cfg), [11, 22, 33]
    greedy = decode_harness(model, prompt, 10, EOT_ID)
    assert decode_harness(model, prompt, 10, EOT_ID, Sampling(temperature=0.7, top_k=1, seed=5)) == greedy
    hot = [decode_harness(model, prompt, 10, EOT_ID, Sampling(temperature=50.0, seed=s)) for s in (1, 1, 2)]
    assert hot[0] == hot[1] and hot[0] != hot[2] and hot[0] != greedy


@pytest.mark.parametrize(
    "overrides, stock",
    [
        ([], "gpt2"),
        (["model.position_embedding=rope", "model.normalization=RMSNorm", "model.num_query_groups=2"], "arcee"),
        (["model.qk_norm=learned"], None),
        (["model.softmax_scale=0.1"], None),
        (["model.moe.num_experts=4"], None),
    ],
)
def test_the_plain_linear_query_uses_a_stock_class_where_one_fits(overrides, stock):
    from nlq_scale.export.hf import stock_class

    assert stock_class(config(arms.baseline().name, overrides).model) == stock
    for arm in arms.names():
        if arm != arms.baseline().name:
            assert stock_class(config(arm, overrides).model) is None


def test_modeling_code_imports_only_torch_and_transformers():
    tree = ast.parse((REPO / "nlq_scale" / "export" / "modeling_nlq.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= {"__future__", "torch", "transformers"}


def test_exported_tokenizer_encodes_as_the_harness(tmp_path):
    from transformers import AutoTokenizer

    from nlq_scale.data.tokenizer import gpt2_tokenizer
    from nlq_scale.export.hf import write_tokenizer

    write_tokenizer(tmp_path, 64)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    enc = gpt2_tokenizer().encoding
    text = "Hello  world!\n\tIt's 2026; naïve café — 東京 12345 ...  \n\n  x"
    assert hf(text)["input_ids"] == enc.encode(text, allowed_special=set(), disallowed_special=())
    assert hf.eos_token_id == enc.eot_token


# ---------------------------------------------------------------- the CLI on real run directories


def train(run_dir: Path, data: Path, nproc: int, *extra: str) -> None:
    r = nlq(
        "train", "--scale", "cpu-xs", "--run-dir", str(run_dir), "--nproc", str(nproc), f"data.path={data}",
        "train.steps=3", "train.warmup_steps=1", "train.eval_every=3", "checkpoint.every=3", "logging.wandb=false",
        *extra,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, sample_dataset) -> Path:
    run_dir = tmp_path_factory.mktemp("export") / "run"
    train(run_dir, sample_dataset, 1, "--arm", "nonlinear")
    return run_dir


def generated(source: Path, *extra: str) -> dict:
    r = cli("generate", str(source), "--prompt", "The history of", "--max-new-tokens", "6", "--json", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_export_and_generate_from_a_run_directory(tiny_run, tmp_path):
    out = tmp_path / "hf"
    r = cli("export", str(tiny_run), "--step", "3", "--format", "hf", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_nlq.py", "tokenizer.json", "vocab.json", "merges.txt"} <= files
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_nlq.NlqForCausalLM"
    ours, theirs = generated(tiny_run), generated(out)
    assert ours["prompt_ids"] == theirs["prompt_ids"]
    assert len(ours["output_ids"]) == 6
    assert ours == theirs


def test_bad_export_input_exits_2_with_one_line_and_overwrites_nothing(tiny_run, tmp_path):
    empty_run = tmp_path / "no-ckpt"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text((tiny_run / "config.yaml").read_text())
    assert "no complete checkpoint" in refused("export", str(empty_run), "--out", str(tmp_path / "a"))
    assert "not a run directory" in refused("export", str(tmp_path), "--out", str(tmp_path / "a"))
    assert "--step 7" in refused("export", str(tiny_run), "--step", "7", "--out", str(tmp_path / "a"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert "not an empty directory" in refused("export", str(tiny_run), "--out", str(full))
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "a").exists()
    assert "exceed" in refused("generate", str(tiny_run), "--prompt", "x", "--max-new-tokens", "500")
    not_export = tmp_path / "not-an-export"
    not_export.mkdir()
    for config in ("{}", '{"model_type": "gpt2"}'):  # no known model type; then no weights or tokenizer
        (not_export / "config.json").write_text(config)
        err = refused("generate", str(not_export), "--prompt", "x")
        assert f"{not_export}: not a transformers export this can load" in err


# ---------------------------------------------------------------- multi-process checkpoints


def val_loss_of_export(out: Path, run_dir: Path) -> float:
    """The export's mean next-token loss on the run's fixed validation sequences."""
    from transformers import AutoModelForCausalLM

    from nlq_scale.data.loader import make_val_set

    cfg = load_run_config(config_path=run_dir / "config.yaml")
    val = make_val_set(cfg.data, seq_length=cfg.model.seq_length)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(val[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), val[:, 1:].flatten()).item()


ZERO3_TP2 = ["train.engine=deepspeed", "train.zero_stage=3", "parallel.tp=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sample_dataset):
    """Each multi-rank run trained once for the module (a test that alters one works on a copy)."""
    runs: dict[tuple, Path] = {}

    def run(nproc: int, arm: str, *extra: str) -> Path:
        key = (nproc, arm, *extra)
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("multi-rank") / "run"
            train(runs[key], sample_dataset, nproc, "--arm", arm, *extra)
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, arm, extra",
    [
        (2, "nonlinear", ["parallel.tp=2"]),
        (2, "preproj", ["parallel.pp=2"]),
        (2, "preproj", ["train.engine=deepspeed", "train.zero_stage=3"]),
        (2, "residual", ["train.engine=deepspeed", "train.zero_stage=0", "parallel.tp=2"]),
        (2, "nonlinear", ["model.moe.num_experts=4", "parallel.ep=2"]),
        (2, "nonlinear", ZERO3_TP2),  # the query's up/down projections are TP-split too
        (4, "nonlinear", ZERO3_TP2),
    ],
    ids=[
        "megatron-tp2", "megatron-pp2", "deepspeed-zero3-dp2", "deepspeed-zero0-tp2", "megatron-moe-ep2",
        "deepspeed-zero3-tp2", "deepspeed-zero3-tp2-dp2",
    ],
)  # fmt: skip
def test_multi_rank_checkpoints_export_to_the_loss_the_ranks_logged(trained, tmp_path, nproc, arm, extra):
    """The ranks' own validation loss at the saved step (their TP/PP/DP model, fp32) is what the
    export computes on the same sequences, and (at TP=2) its greedy tokens are `nlq-scale generate`'s."""
    run_dir, out = trained(nproc, arm, *extra), tmp_path / "hf"
    r = cli("export", str(run_dir), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [m["val/loss"] for m in read_metrics(run_dir) if m.get("step") == 3 and "val/loss" in m][-1]
    assert val_loss_of_export(out, run_dir) == pytest.approx(logged, abs=TOL)
    if "parallel.tp=2" in extra:  # generate reads checkpoints as export does: one sharded layout is enough
        assert generated(run_dir) == generated(out)


@pytest.mark.slow
def test_a_zero3_shard_carrying_code_is_refused_naming_it(trained, tmp_path):
    """DeepSpeed's converter reads the ZeRO shards itself and does not say which one it failed on:
    the export names it."""
    from tests.test_train_reliability import plant_in_torch_file, reseal

    run_dir, marker = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(trained(2, "nonlinear", *ZERO3_TP2), run_dir)
    ckpt = run_dir / "checkpoints" / "step_3"
    shard = ckpt / "deepspeed" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    plant_in_torch_file(shard, marker)
    reseal(ckpt)
    r = cli("export", str(run_dir), "--out", str(tmp_path / "hf"))
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and f"{shard}: refused: not plain checkpoint data" in line, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not marker.exists() and not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- the authors' nanoGPT checkpoints


@pytest.mark.parametrize(
    "mode", [*(pytest.param(m, marks=pytest.mark.slow) for m in ("original", "identity", "residual")), "residual_gelu"]
)
def test_authors_checkpoint_imports_to_a_run_whose_export_gives_their_logits(tmp_path, mode):
    from transformers import AutoModelForCausalLM

    from tests.test_nanogpt_parity import AuthorsGPT, authors_config

    torch.manual_seed(0)
    theirs = AuthorsGPT(authors_config(mode, 2, 4, 64, 32, 50304))
    with torch.no_grad():
        for p in theirs.parameters():  # norm gains away from 1, so a misplaced norm shows
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02) + (1.0 if p.dim() == 1 else 0.0))
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": theirs.state_dict(), "model_args": {"n_head": 4, "query_mode": mode}, "iter_num": 5}, ckpt)
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    r = cli("import-nanogpt", str(ckpt), "--out", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("export", str(run_dir), "--step", "5", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - theirs(tokens)).abs().max().item() <= 1e-5


def test_authors_checkpoint_of_an_unknown_mode_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": {"transformer.wte.weight": torch.zeros(8, 4)}, "model_args": {"n_head": 1}}, ckpt)
    assert "--mode" in refused("import-nanogpt", str(ckpt), "--out", str(tmp_path / "run"), "--mode", "bogus")
    assert "query_mode" in refused("import-nanogpt", str(ckpt), "--out", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_file_that_is_not_a_torch_save_is_refused_in_one_line(tmp_path):
    saved = tmp_path / "saved.pt"
    torch.save({"model": {}}, saved)
    files = {"text.pt": b"a: [1,\n", "empty.pt": b"", "cut.pt": saved.read_bytes()[:300]}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        err = refused("import-nanogpt", str(tmp_path / name), "--out", str(tmp_path / "run"))
        assert f"{tmp_path / name}: not a readable torch file" in err, err
    assert not (tmp_path / "run").exists()
