"""Loading runs: run directories per the train contract, real offline W&B runs read back without
network, and CSV logs imported with `nlq-scale import-csv`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.analysis_rundirs import EVAL_EVERY, STEPS, curve, make_config, tokens_per_step, write_run_dir

from nlq_scale.analysis.runs import load_run_dir, load_runs
from nlq_scale.cli import main
from nlq_scale.errors import UsageError
from nlq_scale.model.accounting import count_parameters, flops_per_token

EVAL_STEPS = np.arange(EVAL_EVERY, STEPS + 1, EVAL_EVERY)


def test_run_directory_fields_and_compute(tmp_path):
    cfg = make_config("nonlinear", "t2", seed=7, lr=2e-3)
    path = write_run_dir(tmp_path, cfg, EVAL_STEPS, curve(3.1, EVAL_STEPS, STEPS))
    run = load_run_dir(path)
    assert (run.arm, run.scale, run.seed, run.lr, run.state) == ("nonlinear", "t2", 7, 2e-3, "completed")
    assert run.final_loss == pytest.approx(3.1) and run.final_step == STEPS
    assert run.params == count_parameters(cfg.model).non_embedding
    assert run.compute == flops_per_token(cfg.model) * STEPS * tokens_per_step(cfg)


def test_accounting_falls_back_to_the_config_when_the_manifest_lacks_it(tmp_path):
    cfg = make_config("linear-mlp4.75", "t1", seed=0, lr=1e-3)
    path = write_run_dir(tmp_path, cfg, EVAL_STEPS, curve(3.1, EVAL_STEPS, STEPS))
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["accounting"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    run = load_run_dir(path)
    assert run.arm == "linear-mlp4.75"  # the variant, not model.arm
    assert run.flops_per_token == flops_per_token(cfg.model)
    assert run.params == count_parameters(cfg.model).non_embedding


def test_metrics_after_resume_torn_last_line_and_malformed_lines(tmp_path):
    cfg = make_config("linear", "t1", seed=0, lr=1e-3)
    path = write_run_dir(tmp_path, cfg, EVAL_STEPS, curve(3.0, EVAL_STEPS, STEPS))
    metrics = path / "metrics.jsonl"
    # a resumed run replays steps after its checkpoint (the later value wins); a kill tore the last line
    replay = json.dumps({"step": STEPS, "tokens": STEPS * tokens_per_step(cfg), "time": 0.0, "val/loss": 2.95})
    metrics.write_text(metrics.read_text() + json.dumps({"step": 140, "event": "resume"}) + "\n" + replay + '\n{"step": 21')
    run = load_run_dir(path)
    assert run.final_loss == 2.95 and len(run.val.step) == len(EVAL_STEPS)

    metrics.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        load_run_dir(path)


def test_missing_roots_and_duplicate_runs(tmp_path):
    with pytest.raises(UsageError, match="no such file or directory"):
        load_runs([str(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no runs found"):
        load_runs([str(tmp_path / "empty")])
    cfg = make_config("linear", "t1", seed=0, lr=1e-3)
    write_run_dir(tmp_path / "a", cfg, EVAL_STEPS, curve(3.0, EVAL_STEPS, STEPS))
    write_run_dir(tmp_path / "b", cfg, EVAL_STEPS, curve(3.0, EVAL_STEPS, STEPS))
    with pytest.raises(UsageError, match="same arm/scale/lr/seed"):
        load_runs([str(tmp_path / "a"), str(tmp_path / "b")])


def _log_wandb_run(dir_, cfg, steps, losses, state="completed", wandb_id=None):
    """Logs the way the train loop's W&B mirror does: step= (no `step` key), summary["state"]."""
    import wandb

    run = wandb.init(mode="offline", dir=str(dir_), project="nlq-test", id=wandb_id, resume="allow" if wandb_id else None,
                     config=cfg.model_dump(mode="json"))
    tps = tokens_per_step(cfg)
    for step, loss in zip(steps, losses):
        run.log({"train/loss": float(loss) + 0.01, "val/loss": float(loss), "tokens": int(step) * tps}, step=int(step))
    run.summary["state"] = state
    run.finish(exit_code=0 if state in ("completed", "preempted") else 1)


def test_offline_wandb_runs_read_back_without_network(tmp_path):
    wandb_dir = tmp_path / "wandb-runs"  # conftest keeps W&B offline with private dirs
    wandb_dir.mkdir()
    losses = curve(3.2, EVAL_STEPS, STEPS)
    losses[-1] = np.nan  # W&B stores it as the string "NaN"
    cfg = make_config("nonlinear", "t3", seed=5, lr=1e-3)
    _log_wandb_run(wandb_dir, cfg, EVAL_STEPS, losses)
    failed = make_config("linear", "t3", seed=5, lr=1e-3)
    _log_wandb_run(wandb_dir, failed, EVAL_STEPS, curve(3.3, EVAL_STEPS, STEPS), state="diverged")

    runs = {r.arm: r for r in load_runs([str(wandb_dir)])}
    assert set(runs) == {"nonlinear", "linear"}
    nl = runs["nonlinear"]
    assert (nl.scale, nl.seed, nl.lr, nl.state, nl.run_id) == ("t3", 5, 1e-3, "completed", cfg.name)
    np.testing.assert_array_equal(nl.val.step, EVAL_STEPS)
    np.testing.assert_allclose(nl.val.loss[:-1], losses[:-1])
    assert np.isnan(nl.val.loss[-1]) and nl.first_nonfinite_train_step == STEPS
    assert nl.final_tokens == STEPS * tokens_per_step(cfg)
    assert nl.params == count_parameters(cfg.model).non_embedding
    assert runs["linear"].state == "diverged"
    (wandb_file,) = Path(nl.source).glob("run-*.wandb")  # a .wandb file is a root too
    assert [r.run_id for r in load_runs([str(wandb_file)])] == [cfg.name]


def test_resumed_wandb_run_segments_are_joined(tmp_path):
    cfg = make_config("linear", "t1", seed=1, lr=1e-3)
    losses = curve(3.0, EVAL_STEPS, STEPS)
    _log_wandb_run(tmp_path, cfg, EVAL_STEPS[:6], losses[:6] + 0.5, state="preempted", wandb_id="resumed0001")
    _log_wandb_run(tmp_path, cfg, EVAL_STEPS[4:], losses[4:], state="completed", wandb_id="resumed0001")
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 2
    (run,) = load_runs([str(tmp_path)])
    assert run.state == "completed" and run.run_id == cfg.name
    np.testing.assert_array_equal(run.val.step, EVAL_STEPS)
    np.testing.assert_allclose(run.val.loss, np.concatenate([losses[:4] + 0.5, losses[4:]]))  # replayed steps: later wins


def test_wandb_mirror_inside_a_run_directory_is_not_counted_twice(tmp_path):
    cfg = make_config("linear", "t1", seed=0, lr=1e-3)
    losses = curve(3.0, EVAL_STEPS, STEPS)
    path = write_run_dir(tmp_path / "root", cfg, EVAL_STEPS, losses)
    _log_wandb_run(path, cfg, EVAL_STEPS, losses)
    assert list(path.glob("wandb/offline-run-*/run-*.wandb"))
    runs = load_runs([str(tmp_path / "root")])
    assert [r.source for r in runs] == [str(path)]


# ---------------------------------------------------------------------------------------------
# import-csv


def _import(tmp_path, csv_text, *extra):
    csv = tmp_path / "log.csv"
    csv.write_text(csv_text)
    return main(["import-csv", str(csv), "--arm", "nonlinear", "--scale", "s1", "--seed", "3",
                 "--out", str(tmp_path / "root"), *extra])


def test_import_csv_round_trip(tmp_path, capsys):
    rows = "\n".join(f"{s},{'' if s % 20 else 6.0 - s / 100},{6.1 - s / 100}" for s in range(10, 101, 10))
    flags = ("--lr", "3e-4", "--params", "1000000", "--tokens-per-step", "4096")
    assert _import(tmp_path, "step,val_loss,train_loss\n" + rows + "\n", *flags) == 0
    dest = capsys.readouterr().out.strip()
    run = load_run_dir(Path(dest))
    assert (run.arm, run.scale, run.seed, run.lr, run.state) == ("nonlinear", "s1", 3, 3e-4, "completed")
    np.testing.assert_array_equal(run.val.step, [20, 40, 60, 80, 100])
    assert run.final_loss == pytest.approx(5.0)
    assert run.params == 1_000_000 and run.compute == 6 * 1_000_000 * 100 * 4096
    # imported again: refused, nothing overwritten
    before = (Path(dest) / "metrics.jsonl").read_text()
    assert _import(tmp_path, "step,val_loss\n1,2.0\n", *flags) == 2
    assert "already exists" in capsys.readouterr().err
    assert (Path(dest) / "metrics.jsonl").read_text() == before


def test_import_csv_without_params_or_lr_knows_it_does_not_know(tmp_path, capsys):
    assert _import(tmp_path, "step,val_loss,tokens\n10,5.0,100\n20,4.0,200\n") == 0
    run = load_run_dir(Path(capsys.readouterr().out.strip()))
    assert run.lr is None and run.params is None and run.compute is None
    assert run.final_tokens == 200


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty CSV"),
        ("step,val_loss\n", "no data rows"),
        ("step,train_loss\n1,2.0\n", "missing column(s) val_loss"),
        ("step,val_loss\n1,abc\n", "line 2: column val_loss: 'abc' is not a number"),
        ("step,val_loss\n1,2.0,7\n", "line 2: 3 fields, the header has 2"),
        ("step,val_loss\n1,\n2,\n", "column val_loss has no values"),
        ("step,val_loss\n1.5,2.0\n", "non-negative integers"),
    ],
)
def test_import_csv_bad_input_is_one_line(tmp_path, capsys, text, message):
    assert _import(tmp_path, text) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "root" / "imported").exists() or not any((tmp_path / "root" / "imported").iterdir())
