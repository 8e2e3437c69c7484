"""`nlq-scale eval`: a run's checkpoint exported to a temporary transformers directory and scored by
lm-evaluation-harness offline (on the GPU where there is one); the results merged into the run's
eval.json (per step).

lm-eval is imported here only, inside the command: `import nlq_scale` never loads it (it pulls in
datasets, pandas, scikit-learn, ...)."""

from __future__ import annotations

import os
import tempfile
from importlib import metadata
from pathlib import Path

from nlq_scale.errors import UsageError, first_line
from nlq_scale.evaluate.tasks import LOCAL_TASKS, REAL_TASKS, stage_local_tasks
from nlq_scale.train import rundir

METRICS = ("acc", "acc_norm", "perplexity")
BOOTSTRAP_ITERS = 1000  # perplexity's stderr is bootstrapped; lm-eval's 100000 takes minutes on CPU


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks: name at least one task, e.g. " + ",".join(LOCAL_TASKS))
    if len(set(tasks)) != len(tasks):
        raise UsageError(f"--tasks {text}: a task is named twice")
    return tasks


def _offline() -> None:
    """Compute nodes have no internet: datasets come from the local cache (HF_DATASETS_CACHE) only.
    setdefault: a login node preparing the cache may say HF_DATASETS_OFFLINE=0."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _serial_bootstrap() -> None:
    """lm-eval bootstraps a stderr in a multiprocessing pool of one process per core and ends it
    with SIGTERM; inside a submitit job (a sweep's evaluation job) the forked workers inherit
    submitit's handler, which ignores SIGTERM, and the job hangs until its time limit. One chunk
    of BOOTSTRAP_ITERS draws is quick in this process. lm-eval 0.4.13 reads DISABLE_MULTIPROC; its
    defaults module already names LMEVAL_DISABLE_MULTIPROC."""
    for name in ("DISABLE_MULTIPROC", "LMEVAL_DISABLE_MULTIPROC"):
        os.environ.setdefault(name, "1")


def check_task_names(names: list[str], manager, field: str = "--tasks") -> None:
    """Every name is a task lm-eval (with the local tasks staged) knows; `field` names the input."""
    for name in names:
        if name not in manager.all_tasks:
            raise UsageError(f"{field} {name}: unknown lm-eval task (local: {', '.join(LOCAL_TASKS)}; "
                             f"with a dataset cache: {', '.join(REAL_TASKS)}, ...)")  # fmt: skip


def task_manager(names: list[str], include: Path):
    """lm-eval's task index over the staged local tasks, and over its own built-in tasks only when a
    name is not a local one: indexing the built-ins reads thousands of YAML files (~10 s of CPU)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include), include_defaults=not set(names) <= set(LOCAL_TASKS))


def check_sweep_tasks(names: list[str]) -> None:
    """`submit`: a sweep's `eval.tasks` are checked before any training job is queued (their datasets
    are not: the evaluation jobs read the compute nodes' cache)."""
    with tempfile.TemporaryDirectory(prefix="nlq-eval-") as tmp:
        stage_local_tasks(Path(tmp))
        check_task_names(names, task_manager(names, Path(tmp)), "eval.tasks:")


def load_tasks(names: list[str], manager) -> dict:
    """lm-eval Task objects by name, each loaded (its dataset read) here, so that an unknown name or
    a dataset missing from the cache is one line naming the task, not a traceback mid-run."""
    check_task_names(names, manager)
    loaded = {}
    for name in names:
        try:
            loaded.update(manager.load([name])["tasks"])
        except Exception as e:  # datasets raises ConnectionError, FileNotFoundError, ValueError, ...
            cache = os.environ.get("HF_DATASETS_CACHE", "~/.cache/huggingface/datasets")
            raise UsageError(f"--tasks {name}: its dataset is not in the local datasets cache ({cache}, offline): "
                             f"{first_line(e)[:200]} (see docs/evaluation.md)") from None  # fmt: skip
    return loaded


def eval_device(requested: str) -> str:
    """`auto`: the GPU where the job has one (a cluster's evaluation job asks for one), else the CPU."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device visible here (use --device auto or cpu)")
    return requested


def _model(export_dir: Path, batch_size: int, remote_code: bool, device: str):
    import logging

    from lm_eval.models.huggingface import HFLM

    # lm-eval warns once per request cut to the model's window: hundreds of lines at a short seq_length.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)

    # float32 on either device: the same numbers as the harness's fp32 logits (docs/export.md).
    return HFLM(pretrained=str(export_dir), device=device, dtype="float32", batch_size=batch_size,
                trust_remote_code=remote_code)  # fmt: skip


def task_results(results: dict, task: str) -> dict:
    """One task's {metric: {"value", "stderr"}, "n"} from simple_evaluate's output."""
    row = results["results"][task]
    metrics = {}
    for name in METRICS:
        if f"{name},none" in row:
            stderr = row.get(f"{name}_stderr,none")
            metrics[name] = {"value": float(row[f"{name},none"]),
                             "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}  # fmt: skip
    return {"metrics": metrics, "n": int(results["n-samples"][task]["effective"])}


def tokens_at(run_dir: Path, step: int) -> int | None:
    """Tokens trained through checkpoint `step`, from the metrics record of that step."""
    for record in reversed(rundir.read_metrics(run_dir)):
        if record.get("step") == step and "tokens" in record:
            return int(record["tokens"])
    return None


def evaluate(run_dir: Path, tasks: list[str], step: int | None = None, limit: int | None = None,
             batch_size: int = 8, device: str = "auto") -> dict:  # fmt: skip
    """Scores the checkpoint on `tasks`, records the result in run_dir's eval.json, returns the entry."""
    from nlq_scale.export.checkpoint import find_checkpoint
    from nlq_scale.export.hf import export_checkpoint, stock_class
    from nlq_scale.runtime.dist import launch_env_restored

    if limit is not None and limit < 1:
        raise UsageError(f"--limit {limit}: must be >= 1")
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: must be >= 1")
    device = eval_device(device)
    ckpt = find_checkpoint(run_dir, step)
    _offline()
    _serial_bootstrap()
    with tempfile.TemporaryDirectory(prefix="nlq-eval-") as tmp:
        local = stage_local_tasks(Path(tmp) / "tasks")
        manager = task_manager(tasks, Path(tmp) / "tasks")
        loaded = load_tasks(tasks, manager)
        export_checkpoint(ckpt, Path(tmp) / "export")
        remote_code = stock_class(ckpt.cfg.model) is None
        from lm_eval import simple_evaluate

        # lm-eval runs in this one process. A rank's environment inherited from a launcher (a
        # LOCAL_RANK) makes accelerate open a process group on a MASTER_PORT it does not own.
        with launch_env_restored(hidden=True):
            results = simple_evaluate(model=_model(Path(tmp) / "export", batch_size, remote_code, device),
                                      tasks=list(loaded.values()), task_manager=manager, limit=limit,
                                      bootstrap_iters=BOOTSTRAP_ITERS, log_samples=False)  # fmt: skip
    entry = {
        "step": ckpt.step, "tokens": tokens_at(run_dir, ckpt.step), "arm": ckpt.cfg.model.arm,
        "lm_eval": metadata.version("lm_eval"), "device": device,
        "tasks": {t: {**task_results(results, t), "limit": limit, **local.get(t, {})} for t in tasks},
    }  # fmt: skip
    return rundir.record_eval(run_dir, ckpt.step, entry)


def table(entry: dict) -> str:
    lines = [f"step {entry['step']}  tokens {entry['tokens']}  lm-eval {entry['lm_eval']}",
             f"{'task':<16} {'metric':<11} {'value':>8} {'stderr':>8} {'n':>6}"]  # fmt: skip
    for task, result in entry["tasks"].items():
        for name, m in result["metrics"].items():
            stderr = "-" if m["stderr"] is None else f"{m['stderr']:.4f}"
            lines.append(f"{task:<16} {name:<11} {m['value']:>8.4f} {stderr:>8} {result['n']:>6}")
    return "\n".join(lines)
