"""`nlq-scale eval`: the local lm-eval tasks are built deterministically from the sample text and load
in lm-eval; eval on tiny trained runs (stock GPT-2 export and remote-code arm) records accuracies in
eval.json per step, and lm-eval's last-word and cloze numbers equal ones computed from the harness's
own logits; bad input is one line, exit 2."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nlq_scale.evaluate import tasks
from tests.conftest import cli, nlq, one_rank, refused
from tests.test_export import train


def test_local_task_documents_are_deterministic_and_well_formed():
    docs = tasks.task_documents()
    assert docs == tasks.task_documents()
    assert {t: len(d) for t, d in docs.items()} == {"nlq_lastword": tasks.TASK_SIZE, "nlq_cloze": tasks.TASK_SIZE}
    texts = tasks.passages()
    for doc in docs["nlq_lastword"]:
        assert doc["text"] + "." in texts and doc["text"].split(" ")[-1].isalpha()
    for i, doc in enumerate(docs["nlq_cloze"]):
        assert len(doc["choices"]) == tasks.CHOICES and len(set(doc["choices"])) == tasks.CHOICES
        assert f"{doc['context']} {doc['choices'][doc['label']]}" in texts  # the true continuation
    assert {d["label"] for d in docs["nlq_cloze"]} == set(range(tasks.CHOICES))


def test_staged_tasks_load_in_lm_eval_with_every_document(tmp_path, monkeypatch):
    from nlq_scale.evaluate.run import task_manager

    monkeypatch.chdir(tmp_path.parent)  # data_files must not depend on the cwd
    info = tasks.stage_local_tasks(tmp_path / "tasks")
    loaded = task_manager(list(tasks.LOCAL_TASKS), tmp_path / "tasks").load(list(tasks.LOCAL_TASKS))["tasks"]
    for name in tasks.LOCAL_TASKS:
        assert len(list(loaded[name].eval_docs)) == info[name]["documents"] == tasks.TASK_SIZE
    assert loaded["nlq_lastword"].doc_to_target(tasks.task_documents()["nlq_lastword"][0]).startswith(" ")


def test_lm_evals_built_in_tasks_are_indexed_only_when_a_name_needs_them(tmp_path):
    """Indexing lm-eval's own tasks reads thousands of YAML files: the local tasks alone skip it."""
    from nlq_scale.evaluate.run import task_manager

    tasks.stage_local_tasks(tmp_path)
    local = task_manager(list(tasks.LOCAL_TASKS), tmp_path).all_tasks
    assert set(tasks.LOCAL_TASKS) <= set(local) and "hellaswag" not in local
    mixed = task_manager(["nlq_cloze", "hellaswag"], tmp_path).all_tasks
    assert {"nlq_cloze", "hellaswag"} <= set(mixed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sample_dataset) -> dict[str, Path]:
    """3-step runs: the linear arm (exports as stock GPT-2) and nonlinear (trust_remote_code)."""
    out = {}
    for arm in ("linear", "nonlinear"):
        out[arm] = tmp_path_factory.mktemp("eval") / arm
        train(out[arm], sample_dataset, 1, "--arm", arm)
    return out


def evaluated(run_dir: Path, *args: str, env: dict | None = None, own_process: bool = False) -> dict:
    r = (nlq if own_process else cli)("eval", str(run_dir), "--json", *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def accuracies(entry: dict) -> list[float]:
    return [m["value"] for t in entry["tasks"].values() for name, m in t["metrics"].items() if name.startswith("acc")]


def test_eval_records_accuracies_per_step_for_stock_and_remote_code_arms(runs):
    full = evaluated(runs["linear"], "--tasks", "nlq_lastword,nlq_cloze")
    assert {t: r["n"] for t, r in full["tasks"].items()} == {"nlq_lastword": 100, "nlq_cloze": 100}
    # Started by a one-process launcher whose MASTER_PORT another process holds now: lm-eval's
    # accelerate must not try to rendezvous there (a CI run failed on it: EADDRINUSE). In a process
    # of its own: accelerate keeps its state per process, so an eval run here before would hide it.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held.getsockname()[1])}  # fmt: skip
        limited = evaluated(runs["nonlinear"], "--tasks", "nlq_cloze", "--limit", "12", "--step", "3", env=launcher,
                            own_process=True)
    assert limited["tasks"]["nlq_cloze"]["n"] == 12 and limited["arm"] == "nonlinear"
    with one_rank():
        acc, acc_norm = harness_cloze(runs["nonlinear"], tasks.task_documents()["nlq_cloze"][:12])
    cloze = limited["tasks"]["nlq_cloze"]["metrics"]
    assert (cloze["acc"]["value"], cloze["acc_norm"]["value"]) == pytest.approx((acc, acc_norm), abs=1e-9)
    for entry in (full, limited):
        assert entry["step"] == 3 and entry["tokens"] > 0 and entry["device"] == "cpu"
        assert all(0.0 <= a <= 1.0 for a in accuracies(entry)) and len(accuracies(entry)) >= 2

    # A second task at the same step joins the first; the file keeps one entry per step. Its
    # numbers equal ones computed from the harness's own logits.
    limit = 6
    entry = evaluated(runs["nonlinear"], "--tasks", "nlq_lastword", "--limit", str(limit))
    stored = json.loads((runs["nonlinear"] / "eval.json").read_text())
    assert list(stored) == ["3"] and set(stored["3"]["tasks"]) == {"nlq_cloze", "nlq_lastword"}
    assert stored["3"]["tasks"]["nlq_cloze"]["n"] == 12
    with one_rank():
        acc, ppl = harness_lastword(runs["nonlinear"], tasks.task_documents()["nlq_lastword"][:limit])
    metrics = entry["tasks"]["nlq_lastword"]["metrics"]
    assert metrics["acc"]["value"] == acc
    assert metrics["perplexity"]["value"] == pytest.approx(ppl, rel=1e-4)


def harness_lastword(run_dir: Path, docs: list[dict]) -> tuple[float, float]:
    """(acc, perplexity) of the last-word task from the megatron model's own logits."""
    loglik = harness_loglikelihood(run_dir)
    results = [loglik(*doc["text"].rsplit(" ", 1)) for doc in docs]
    acc = sum(greedy for _, greedy in results) / len(docs)
    return acc, math.exp(-sum(ll for ll, _ in results) / len(docs))


def harness_cloze(run_dir: Path, docs: list[dict]) -> tuple[float, float]:
    """(acc, acc_norm) of the cloze task from the megatron model's own logits: the choice with the
    highest log-likelihood, and per character of the choice (lm-eval's acc_norm)."""
    loglik = harness_loglikelihood(run_dir)
    acc = acc_norm = 0
    for doc in docs:
        lls = [loglik(doc["context"], choice)[0] for choice in doc["choices"]]
        acc += max(range(len(lls)), key=lambda i: lls[i]) == doc["label"]
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(doc["choices"][i])) == doc["label"]
    return acc / len(docs), acc_norm / len(docs)


def harness_loglikelihood(run_dir: Path) -> Callable[[str, str], tuple[float, bool]]:
    """(log-likelihood, greedy) of " word" after a context from the megatron model's logits,
    tokenized with the harness's tokenizer and cut to the model's window as lm-eval cuts (the last
    seq_length + 1 tokens). Call inside a one-rank block (one_rank)."""
    from nlq_scale.data.tokenizer import gpt2_tokenizer
    from nlq_scale.export.checkpoint import find_checkpoint, load_harness_model

    ckpt = find_checkpoint(run_dir, None)
    model, window = load_harness_model(ckpt), ckpt.cfg.model.seq_length
    encode = gpt2_tokenizer().encoding.encode

    def loglik(context: str, word: str) -> tuple[float, bool]:
        ctx = encode(context)
        target = encode(f"{context} {word}")[len(ctx):]
        tokens = torch.tensor((ctx + target)[-(window + 1):][:-1])[None]
        with torch.no_grad():
            logp = model(tokens, torch.arange(tokens.shape[1])[None], None).float().log_softmax(-1)[0, -len(target):]
        return logp[torch.arange(len(target)), torch.tensor(target)].sum().item(), logp.argmax(-1).tolist() == target

    return loglik


def test_eval_prints_no_library_progress_or_notices(runs, tmp_path):
    """datasets' progress bars (a fresh cache builds the local tasks' splits) and transformers'
    tokenizer-length notice (the tiny model's 64-token context) stay out of eval's output."""
    r = nlq("eval", str(runs["linear"]), "--tasks", "nlq_lastword,nlq_cloze", "--limit", "5",
            env={"HF_DATASETS_CACHE": str(tmp_path / "hf")})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for noise in ("Generating test split", "Token indices sequence length"):
        assert noise not in r.stderr, r.stderr


def test_bad_eval_input_exits_2_with_one_line(runs, tmp_path):
    assert "unknown lm-eval task" in refused("eval", str(runs["linear"]), "--tasks", "no_such_task")
    assert "not a run directory" in refused("eval", str(tmp_path), "--tasks", "nlq_cloze")
    assert "--step 7" in refused("eval", str(runs["linear"]), "--tasks", "nlq_cloze", "--step", "7")
    assert "--limit" in refused("eval", str(runs["linear"]), "--tasks", "nlq_cloze", "--limit", "0")
    if not torch.cuda.is_available():
        assert "--device cuda: no CUDA device" in refused("eval", str(runs["linear"]), "--tasks", "nlq_cloze",
                                                          "--device", "cuda")  # fmt: skip
    # lm-eval's own task, whose dataset this machine has never downloaded: one line, not a traceback.
    r = nlq("eval", str(runs["linear"]), "--tasks", "lambada_openai", env={"HF_DATASETS_CACHE": str(tmp_path / "hf")})
    assert r.returncode == 2 and "not in the local datasets cache" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_stderr_bootstrap_runs_without_a_process_pool(monkeypatch):
    """lm-eval's pool ends its workers with SIGTERM, which workers forked inside a submitit job
    ignore (the evaluation job hung): evaluate makes lm-eval bootstrap in its own process."""
    import multiprocessing

    from lm_eval.api.metrics import bootstrap_stderr, mean

    from nlq_scale.evaluate import run

    for name in ("DISABLE_MULTIPROC", "LMEVAL_DISABLE_MULTIPROC"):
        monkeypatch.setenv(name, "")  # recorded, so what _serial_bootstrap sets is undone after the test
        monkeypatch.delenv(name)
    run._serial_bootstrap()
    monkeypatch.setattr(multiprocessing, "Pool", lambda *a, **k: pytest.fail("lm-eval started a process pool"))
    assert 0.0 < bootstrap_stderr(mean, [0.0, 1.0] * 50, run.BOOTSTRAP_ITERS) < 0.1
