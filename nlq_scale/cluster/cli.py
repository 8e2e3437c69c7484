"""Sub-commands `plan`, `submit`, `status` and `cancel` (kept light: heavy imports happen in the handlers)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_commands(sub: argparse._SubParsersAction) -> None:
    from nlq_scale.config.load import available

    sweeps, clusters = ", ".join(available("sweeps")), ", ".join(available("clusters"))
    p = sub.add_parser("plan", help="resources, memory and cost per run of a sweep",
                       usage="nlq-scale plan SWEEP [key=value ...] [--cluster CLUSTER] [--lr-proxy WIDTH] [--json]",
                       epilog="example:\n  nlq-scale plan ladder --cluster example-8x80gb")
    _sweep_and_overrides(p, sweeps)
    _cluster(p, clusters)
    p.add_argument("--lr-proxy", type=int, metavar="WIDTH",
                   help="also price the proxy learning-rate search: each arm's grid at this width under muP "
                        "(docs/mup.md), then every seed at the best LR plus one seed at each neighbour "
                        "(default: the sweep's lr_search width when its strategy is proxy)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("submit", help="submit a sweep's runs (idempotent: finished runs are skipped)",
                       usage="nlq-scale submit SWEEP [key=value ...] [--root DIR] [--cluster CLUSTER] "
                             "[--executor {slurm,local}] [--only PATTERN] [--dry-run] [--retry-failed] "
                             "[--retry-stale] [--stale-after SECONDS] [--json]",
                       epilog="example:\n  nlq-scale submit ladder --root /scratch/nlq data.path=/data/owt-2048 "
                              "--only '124m-*' --dry-run")
    _sweep_and_overrides(p, sweeps)
    p.add_argument("--root", help="run root (default: the sweep's root, else ./runs)")
    _cluster(p, clusters)
    p.add_argument("--executor", choices=("slurm", "local"), default="slurm",
                   help="slurm: queue job arrays; local: run the jobs one by one on this machine (exit 1 when "
                        "one does not complete)")
    p.add_argument("--only", action="append", metavar="PATTERN",
                   help="only the runs whose id matches this shell pattern, e.g. '124m-*' or '*-nonlinear-s1234-*' "
                        "(repeatable; run ids: <scale>-<arm>-s<seed>-lr<lr>)")
    p.add_argument("--dry-run", action="store_true", help="print what would be submitted, submit nothing")
    p.add_argument("--retry-failed", action="store_true", help="also resubmit runs whose state is failed")
    p.add_argument("--retry-stale", action="store_true",
                   help="also resubmit stale runs (running, no heartbeat for too long), cancelling their job first")
    _stale_after(p)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="one row per run: state, progress, loss, job, error",
                       epilog="example:\n  nlq-scale status /scratch/nlq/ladder --watch 60")
    p.add_argument("root", help="run root, sweep dir or run dir")
    _stale_after(p)
    p.add_argument("--watch", type=float, nargs="?", const=WATCH_EVERY_S, metavar="SECONDS",
                   help=f"redraw every SECONDS (default {WATCH_EVERY_S:g}) until no run is queued or running")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="cancel the live jobs (SLURM or local) of every run under a sweep dir",
                       epilog="example:\n  nlq-scale cancel /scratch/nlq/ladder --dry-run")
    p.add_argument("root", metavar="SWEEP_ROOT", help="sweep dir (ROOT/SWEEP), run root or run dir")
    p.add_argument("--dry-run", action="store_true", help="list the jobs that would be cancelled")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_cancel)


WATCH_EVERY_S = 30.0
LIVE_STATES = ("submitted", "pending", "running")  # states that change without a new submit


def _cluster(p: argparse.ArgumentParser, known: str) -> None:
    p.add_argument("--cluster", help=f"cluster file, or a name among: {known} (default: the sweep's)")


def _stale_after(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stale-after", type=float, metavar="SECONDS",
                   help="heartbeat age that makes a running run stale (default: 10 of its slowest steps, "
                        "at least 300 s)")


def _sweep_and_overrides(p: argparse.ArgumentParser, known: str) -> None:
    p.add_argument("items", nargs="+", metavar="SWEEP",
                   help=f"sweep file, or a name among: {known}; then key=value config overrides for every run")


def _load(args: argparse.Namespace):
    args.sweep, *args.overrides = args.items
    return load_sweep_and_cluster(args.sweep, args.cluster)


def load_sweep_and_cluster(name: str, cluster: str | None):
    """A sweep by file or name, and the cluster named on the command line or else in the sweep."""
    from nlq_scale.cluster.plan import load_cluster
    from nlq_scale.cluster.sweep import load_sweep, sweep_path
    from nlq_scale.errors import UsageError

    sweep = load_sweep(sweep_path(name))
    cluster_name = cluster or sweep.cluster
    if cluster_name is None:
        raise UsageError(f"{name}: cluster: not set; pass --cluster CLUSTER.yaml")
    return sweep, load_cluster(cluster_name)


def cmd_plan(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json
    from nlq_scale.cluster.plan import plan_sweep, proxy_search_cost, totals

    sweep, cluster = _load(args)
    runs = plan_sweep(sweep, cluster, args.overrides)
    plans = [r.plan for r in runs]
    doc = {"sweep": sweep.name, "cluster": cluster.name, "runs": [p.as_dict() for p in plans], "totals": totals(plans)}
    width = args.lr_proxy or (sweep.lr_search.width if sweep.lr_search.strategy == "proxy" else None)
    if width is not None:
        doc["lr_proxy"] = proxy_search_cost(runs, cluster, width)
    if args.json:
        emit_json(doc)
    else:
        print(_plan_table(doc))
        if "lr_proxy" in doc:
            print(_proxy_lines(doc["lr_proxy"]))
    return 0


def _proxy_lines(cost: dict) -> str:
    lines = [f"LR search, per-rung grid vs proxy at width {cost['width']} (muP):"]
    for scale, row in cost["per_scale"].items():
        lines.append(f"  scale {scale}: grid {row['grid']:.3g} GPU-h; proxy {row['proxy']:.3g} + target "
                     f"{row['target']:.3g} = {row['proxy'] + row['target']:.3g} GPU-h")
    lines.append(f"  sweep: grid {cost['grid_gpu_hours']:.3g} GPU-h; proxy strategy {cost['strategy_gpu_hours']:.3g} GPU-h"
                 + (f" ({cost['saving']:.2f}x less)" if cost["saving"] else ""))
    return "\n".join(lines)


def _plan_table(doc: dict) -> str:
    head = ("run", "nodes", "gpus", "tp", "pp", "dp", "engine", "mbs", "accum", "mem/GPU GiB", "tokens", "PFLOP",
            "GPU-h")
    rows = []
    for r in doc["runs"]:
        engine = r["engine"] + (f"/zero{r['zero_stage']}" if r["zero_stage"] is not None else
                                "/distopt" if r["distributed_optimizer"] else "")
        m = r["memory_gb"]
        mem = f"{m['total']:.3g} (p{m['params']:.3g} g{m['grads']:.3g} o{m['optimizer']:.3g} a{m['activations']:.3g})"
        rows.append((r["run_id"], r["nodes"], r["gpus"], r["tp"], r["pp"], r["dp"], engine, r["micro_batch_size"],
                     r["grad_accum"], mem, f"{r['tokens']:.3g}", f"{r['flops'] / 1e15:.3g}", f"{r['gpu_hours']:.3g}"))
    lines = _columns(head, rows)
    for scale, t in doc["totals"]["per_scale"].items():
        lines.append(f"scale {scale}: {t['runs']} runs, {t['tokens']:.3g} tokens, {t['flops'] / 1e15:.3g} PFLOP, "
                     f"{t['gpu_hours']:.3g} GPU-h")
    t = doc["totals"]["sweep"]
    lines.append(f"sweep {doc['sweep']} on {doc['cluster']}: {t['runs']} runs, {t['flops'] / 1e15:.3g} PFLOP, "
                 f"{t['gpu_hours']:.3g} GPU-h")
    return "\n".join(lines)


def _columns(head: tuple, rows: list[tuple]) -> list[str]:
    cells = [[str(c) for c in row] for row in [head, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit what is due. With `lr_search: proxy`, phase 1's proxies come first: locally a second
    pass submits the targets once they ended; on SLURM a follow-up job after them does (lr_search)."""
    from nlq_scale.cli import emit_json
    from nlq_scale.cluster import lr_search
    from nlq_scale.errors import check_creatable

    sweep, cluster = _load(args)
    root = Path(args.root or sweep.root or "runs").resolve()
    if not args.dry_run:
        check_creatable(root, "--root" if args.root else "root (the sweep's)")
    rows: list[dict] = []
    while True:
        waiting, records, done = _submit_due(args, sweep, cluster, root)
        rows += done
        finished = not waiting or args.dry_run or not records
        if finished or args.executor == "slurm":
            lr_search.report_waiting(waiting)
        if args.json and (finished or args.executor == "slurm" or _incomplete(records, root / sweep.name, args.executor)):
            emit_json({"sweep": sweep.name, "root": str(root), "dry_run": args.dry_run, "executor": args.executor,
                       "runs": rows, "lr_search_waiting": waiting})
        _fail_unless_completed(records, root / sweep.name, args.executor)
        if finished:
            return 0
        if args.executor == "slurm":
            _follow_up(args, sweep, cluster, root, [r["job_id"] for r in records])
            return 0


def _follow_up(args, sweep, cluster, root: Path, after: list[str]) -> None:
    from nlq_scale.cluster.executors import submit_follow_up
    from nlq_scale.cluster.lr_search import FollowUp
    from nlq_scale.cluster.sweep import sweep_path

    argv = ["submit", str(sweep_path(args.sweep).resolve()), *args.overrides, "--root", str(root),
            "--executor", "slurm", "--cluster", args.cluster or sweep.cluster]  # fmt: skip
    argv += [a for pattern in args.only or [] for a in ("--only", pattern)]
    job = submit_follow_up(cluster, root, sweep.name, after, FollowUp(argv))
    print(f"lr search: job {job} submits the targets once the proxy jobs have ended", file=sys.stderr)


def _submit_due(args, sweep, cluster, root: Path) -> tuple[list[str], list[dict], list[dict]]:
    """One pass of `submit`: plan, check and submit the runs due now (a table on stdout unless
    --json). Returns the lr-search lines, the job records and one row per run."""
    from nlq_scale.cluster import lr_search
    from nlq_scale.cluster.executors import decide_and_submit
    from nlq_scale.cluster.plan import check_launchable, plan_specs
    from nlq_scale.cluster.sweep import check_prepared_data, expand

    specs, waiting = expand(sweep, args.overrides), []
    if sweep.lr_search.strategy == "proxy":
        specs, waiting = lr_search.due_runs(sweep, specs, root)
    runs = _only(plan_specs(sweep, specs, cluster), args.only, sweep.name)
    check_launchable(runs)
    check_prepared_data(r.spec for r in runs)
    if sweep.eval is not None:
        from nlq_scale.evaluate.run import check_sweep_tasks

        check_sweep_tasks(sweep.eval.tasks)
    decisions, records = decide_and_submit(runs, root, sweep.name, cluster, args.executor, dry_run=args.dry_run,
                                           retry_failed=args.retry_failed, retry_stale=args.retry_stale,
                                           stale_s=args.stale_after, evaluation=sweep.eval)
    jobs = {r["run_id"]: r for r in records}
    rows = [
        {"run_id": d.run.spec.run_id, "action": d.action, "reason": d.reason, "run_dir": str(d.run_dir),
         "nodes": d.run.plan.layout.nodes, "tasks_per_node": d.run.plan.layout.tasks_per_node,
         "job_id": jobs.get(d.run.spec.run_id, {}).get("job_id"),
         "eval_job_id": jobs.get(d.run.spec.run_id, {}).get("eval_job_id")}
        for d in decisions
    ]
    if not args.json:
        verb = "would submit" if args.dry_run else "submitted"
        head = ("run", "action", "job", "nodes x tasks", "reason")
        body = [(r["run_id"], r["action"], r["job_id"] or "-", f"{r['nodes']}x{r['tasks_per_node']}", r["reason"])
                for r in rows]
        print("\n".join(_columns(head, body)))
        print(f"{verb} {sum(d.action != 'skip' for d in decisions)} of {len(rows)} runs of sweep {sweep.name} "
              f"({args.executor}) under {root}", file=sys.stderr)
    return waiting, records, rows


def _only(runs: list, patterns: list[str] | None, sweep: str) -> list:
    from fnmatch import fnmatchcase

    from nlq_scale.errors import UsageError

    if not patterns:
        return runs
    kept = [r for r in runs if any(fnmatchcase(r.spec.run_id, p) for p in patterns)]
    if not kept:
        ids = [r.spec.run_id for r in runs]
        shown = ", ".join(ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
        raise UsageError(f"--only {' '.join(patterns)}: matches none of sweep {sweep}'s runs ({shown})")
    return kept


def _incomplete(records: list[dict], sweep_dir: Path, executor: str) -> list[str]:
    """The local runs of these records that ended without completing, as 'run (state)'."""
    from nlq_scale.train.rundir import read_status

    if executor != "local":
        return []
    states = [(r["run_id"], read_status(sweep_dir / r["run_id"]).get("state") or "no status") for r in records]
    return [f"{run} ({state})" for run, state in states if state != "completed"]


def _fail_unless_completed(records: list[dict], sweep_dir: Path, executor: str) -> None:
    """Local runs ended here: one that did not complete makes the command fail (exit 1)."""
    from nlq_scale.errors import RunFailure

    bad = _incomplete(records, sweep_dir, executor)
    if bad:
        raise RunFailure(f"{len(bad)} of {len(records)} local runs did not complete: {', '.join(bad)} "
                         f"(nlq-scale status {sweep_dir})")


def cmd_status(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json
    from nlq_scale.cluster.status import collect, format_table
    from nlq_scale.errors import existing_directory

    root = existing_directory(Path(args.root))
    if args.watch is not None:
        return _watch(root.resolve(), args.stale_after, args.watch)
    rows = collect(root.resolve(), args.stale_after)
    if args.json:
        emit_json({"root": str(root.resolve()), "runs": rows})
    else:
        print(format_table(rows))
    return 0


def _watch(root: Path, stale_s: float | None, every_s: float) -> int:
    """Redraw the table (in place on a terminal) until no run is queued or running; Ctrl-C stops it."""
    import time

    from nlq_scale.cluster.status import collect, format_table

    clear = "\033[H\033[J" if sys.stdout.isatty() else ""
    try:
        while True:
            rows = collect(root, stale_s)
            print(f"{clear}{time.strftime('%H:%M:%S')}  {root}\n{format_table(rows)}", flush=True)
            if not any(r["state"] in LIVE_STATES for r in rows):
                return 0
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json
    from nlq_scale.cluster.executors import JOB_FILE, cancel_job, job_liveness, read_json
    from nlq_scale.cluster.status import find_run_dirs
    from nlq_scale.errors import UsageError, existing_directory

    root = existing_directory(Path(args.root)).resolve()
    dirs = [d for d in find_run_dirs(root) if (d / JOB_FILE).exists()]
    alive = job_liveness(dirs)
    unknown = [d.name for d in dirs if alive.get(d) is None]
    if unknown:
        raise UsageError(f"cannot ask the scheduler about the jobs of {', '.join(unknown)} (no squeue here)")
    live = [d for d in dirs if alive.get(d)]
    rows = [{"run": d.name, "job_id": read_json(d / JOB_FILE)["job_id"]} for d in live]
    if not args.dry_run:
        for d in live:
            cancel_job(read_json(d / JOB_FILE))
    if args.json:
        emit_json({"root": str(root), "dry_run": args.dry_run, "cancelled": rows})
    else:
        verb = "would cancel" if args.dry_run else "cancelled"
        for row in rows:
            print(f"{verb} {row['run']} (job {row['job_id']})")
        print(f"{verb} {len(rows)} of {len(dirs)} submitted runs under {root}", file=sys.stderr)
    return 0
