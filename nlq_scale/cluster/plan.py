"""Resource planner: per run, the parallel layout, the memory per GPU and the cost.

Memory per GPU (the stage that holds the most):
- model state: parameters + fp32 gradients + optimizer state (Adam m and v, plus an fp32 master copy
  with bf16), with tensor- and pipeline-parallel splits; the distributed optimizer (megatron) or ZeRO
  stage 1/2/3 (DeepSpeed) further shards optimizer state / gradients / parameters over DP.
- activations kept for backward, per micro-batch, after Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", Table 2) without dropout (our models have none):
  per layer 4sbh replicated (two norm inputs and the two linear-layer inputs; split by t only with
  sequence parallelism) + sb(q + k + v + context + 2 ffn)/t inside the tensor-parallel regions +
  what the arm's query path adds (Arm.activation_elements; with parallel.recompute_query only what
  Arm.recomputed_activation_elements keeps, plus one layer's recomputation in flight) +
  a s^2 b / t attention probabilities (6 bytes each in bf16, `_score_bytes`) unless recompute is
  selective or full or model.core_attention is sdpa; full recompute keeps only each layer's input
  plus one layer's working set. The first pipeline
  stage holds min(pp, micro-batches) micro-batches in flight (1F1B). The last stage also holds the
  fp32 logits' softmax and its gradient (2 x sbV/t x 4 bytes), which dominate tiny models.
Layout search: the smallest model-parallel size that fits, preferring tensor parallelism inside a node
over pipeline stages (pp = 1, 2, 4, ... outer; tp = 1, 2, 4, ... up to GPUs per node inner); then,
for each micro-batch from the largest down (`_micro_batches`), the query MLP's recompute where only
it makes that micro-batch fit (unless the sweep sets parallel.recompute_query). DP fills the run's
nodes. A sweep's runs of one scale and layout then share the smallest micro-batch any of them got.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Literal

from pydantic import Field, PositiveFloat, PositiveInt, ValidationError

from nlq_scale import arms
from nlq_scale.cluster.sweep import RunSpec, SweepConfig, expand
from nlq_scale.config.load import available, config_file, build_run_config, read_yaml, validation_message
from nlq_scale.config.schema import ModelConfig, RunConfig, Strict
from nlq_scale.errors import UsageError
from nlq_scale.model.accounting import count_parameters, ffn_hidden_size, flops_per_token
from nlq_scale.shape import norm_params

GB = 1024**3


class ClusterConfig(Strict):
    """What a cluster offers one run, and how to ask SLURM for it."""

    name: str
    device: Literal["gpu", "cpu"] = Field("gpu", description="cpu: each 'GPU' is one CPU process (test clusters)")
    nodes: PositiveInt = Field(description="most nodes one run may use")
    gpus_per_node: PositiveInt = Field(description="devices per node; one task (rank) per device")
    gpu_memory_gb: PositiveFloat = Field(description="memory per device (GiB)")
    memory_headroom: float = Field(0.9, gt=0.0, le=1.0, description="usable fraction (allocator fragmentation)")
    overhead_gb: float = Field(2.0, ge=0.0, description="fixed per device: CUDA context, NCCL buffers")
    peak_tflops: PositiveFloat = Field(description="dense bf16 peak per device (TFLOP/s)")
    assumed_mfu: float = Field(0.4, gt=0.0, le=1.0, description="for the GPU-hour estimate")
    partition: str | None = Field(None, description="sbatch --partition; None = the cluster's default")
    account: str | None = Field(None, description="sbatch --account")
    qos: str | None = Field(None, description="sbatch --qos")
    constraint: str | None = Field(None, description="sbatch --constraint, e.g. 'a100-80gb'")
    exclusive: bool = Field(False, description="sbatch --exclusive: no other job shares a run's nodes")
    gres: str | None = Field(None, description="sbatch --gres, e.g. 'gpu:8', where the cluster asks for GPUs "
                                                "that way (then --gpus-per-node is not sent)")
    exclude: str | None = Field(None, description="sbatch --exclude: nodes never to use, e.g. 'node[07,12]'")
    time_limit_min: PositiveInt = Field(60 * 24, description="per job; longer runs requeue (checkpointed)")
    cpus_per_task: PositiveInt | None = None
    mem_gb: PositiveFloat | None = Field(None, description="host memory per node to request")
    array_parallelism: PositiveInt = Field(16, description="runs of one array running at once")
    max_num_timeout: int = Field(20, ge=0, description="requeues after hitting the time limit")
    signal_delay_s: PositiveInt = Field(120, description="USR2 this long before the time limit: checkpoint time")
    setup: list[str] = Field(default_factory=list, description="shell lines before srun (modules, venv)")

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_memory_gb * self.memory_headroom - self.overhead_gb) * GB


def load_cluster(name_or_path: str) -> ClusterConfig:
    path = config_file("clusters", name_or_path)
    if not path.is_file():
        raise UsageError(f"cluster file {path} not found (known: {', '.join(available('clusters'))})")
    try:
        return ClusterConfig.model_validate(read_yaml(path))
    except ValidationError as e:
        raise UsageError(validation_message(e, str(path))) from None


@dataclass(frozen=True)
class Memory:
    """Bytes per device on the fullest pipeline stage."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def as_gb(self) -> dict[str, float]:
        out = {k: round(v / GB, 3) for k, v in asdict(self).items()}
        out["total"] = round(self.total / GB, 3)
        return out


@dataclass(frozen=True)
class Layout:
    nodes: int
    tasks_per_node: int
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    grad_accum: int
    recompute: str
    sequence_parallel: bool
    recompute_query: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


# ---------------------------------------------------------------- memory model


def _stage_params(m: ModelConfig, tp: int, pp: int, ep: int, first: bool, last: bool) -> float:
    """Parameters held by one device of a pipeline stage."""
    per_layer = 0.0
    for name, count in count_parameters(m).per_layer.items():
        if "norm" in name:  # norms see the full hidden vector: replicated across TP
            per_layer += count
        elif name == "mlp" and m.moe.num_experts:
            per_layer += count / (tp * ep)
        else:
            per_layer += count / tp
    params = per_layer * m.num_layers / pp
    word = m.padded_vocab_size * m.hidden_size / tp
    if first:
        params += word + (m.seq_length * m.hidden_size if m.position_embedding == "learned_absolute" else 0)
    if last:
        params += norm_params(m, m.hidden_size)  # final norm
        if not m.tie_embeddings or not first:  # the output layer, or the tied embedding's copy
            params += word
    return params


def _state_bytes_per_param(cfg: RunConfig, dp: int) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per parameter after DP sharding."""
    bf16 = cfg.model.bf16
    # Gradients accumulate in fp32 even with bf16 weights (Megatron-LM's default for bf16, DeepSpeed's
    # bf16 optimizer); mixed precision adds fp32 master weights to Adam's m and v.
    weights, grads = (2.0 if bf16 else 4.0), 4.0
    optimizer = 8.0 + (4.0 if bf16 else 0.0)
    t = cfg.train
    if t.engine == "megatron":
        if t.distributed_optimizer:
            optimizer /= dp
    else:
        if t.zero_stage >= 1:
            optimizer /= dp
        if t.zero_stage >= 2:
            grads /= dp
        if t.zero_stage >= 3:
            weights /= dp
    return weights, grads, optimizer


def _arm_elements(m: ModelConfig, tokens: int, recompute_query: bool) -> tuple[float, float]:
    """What the arm's query path keeps per layer (replicated, split), with or without its recompute."""
    arm = arms.get(m.arm)
    if arm.recomputes_query(m, recompute_query):
        return arm.recomputed_activation_elements(m, tokens)
    return arm.activation_elements(m, tokens)


def layer_activation_bytes(
    m: ModelConfig, b: int, tp: int, sp: bool, recompute: str, recompute_query: bool = False
) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch of b sequences, per device."""
    s, h, dk = m.seq_length, m.hidden_size, m.head_dim
    a, g = m.num_attention_heads, m.query_groups
    width = _activation_width(m)
    if recompute == "full":
        return s * b * h / (tp if sp else 1) * width
    arm_replicated, arm_split = _arm_elements(m, s * b, recompute_query)
    replicated = 4 * s * b * h + arm_replicated
    split = s * b * (a * dk + 2 * g * dk + a * dk + 2 * ffn_hidden_size(m)) + arm_split
    full = (replicated / (tp if sp else 1) + split / tp) * width
    if recompute == "none" and m.core_attention != "sdpa":  # SDPA's kernels keep softmax statistics only
        full += a * s * s * b / tp * _score_bytes(m)
    return full


def _activation_width(m: ModelConfig) -> int:
    """Bytes per activation element: the model's compute precision."""
    return 2 if m.bf16 else 4


def _score_bytes(m: ModelConfig) -> int:
    """Bytes megatron's unfused attention keeps per [b, heads, s, s] element. In bf16 its torch softmax
    runs in fp32 (attention_softmax_in_fp32) and backward keeps that output and its bf16 copy for the
    value GEMM: 6 bytes (H100, 124M: 10.4 GiB per 1.8G elements, docs/performance.md); only
    megatron's compiled fused softmax, which pip's megatron-core does not ship, keeps 2."""
    return 6 if m.bf16 else 4


def activation_bytes(cfg: RunConfig, layout: Layout, first: bool, last: bool) -> float:
    m = cfg.model
    b, tp, pp = layout.micro_batch_size, layout.tp, layout.pp
    width = _activation_width(m)
    sp = layout.sequence_parallel
    per_layer = layer_activation_bytes(m, b, tp, sp, layout.recompute, layout.recompute_query)
    layers = m.num_layers / pp
    in_flight = min(pp, layout.grad_accum) if first else 1
    total = per_layer * layers * in_flight
    if layout.recompute == "full":  # one layer recomputed at a time keeps its whole working set
        total += layer_activation_bytes(m, b, tp, sp, "none")
    elif layout.recompute_query:  # so does one layer's recomputed query path
        total += layer_activation_bytes(m, b, tp, sp, layout.recompute) - per_layer
    if last:
        s, h = m.seq_length, m.hidden_size
        total += 2 * s * b * h * width  # final norm input and output
        total += 2 * s * b * m.padded_vocab_size / tp * 4  # fp32 softmax of the logits + its gradient
    return total


def one_device_layout(cfg: RunConfig) -> Layout:
    """The run on one device at its own micro-batch and recompute settings (the layout memory is
    measured at on CPU)."""
    p = cfg.parallel
    return Layout(1, 1, 1, 1, 1, cfg.train.micro_batch_size, 1, p.recompute, False, p.recompute_query)


def memory_per_device(cfg: RunConfig, layout: Layout) -> Memory:
    """The fullest pipeline stage's bytes per device (first stage: embedding + in-flight micro-batches;
    last stage: output layer + logits)."""
    m = cfg.model
    w, g, o = _state_bytes_per_param(cfg, layout.dp)
    stages = [(True, layout.pp == 1), (False, True)] if layout.pp > 1 else [(True, True)]
    best: Memory | None = None
    for first, last in stages:
        params = _stage_params(m, layout.tp, layout.pp, cfg.parallel.ep, first, last)
        mem = Memory(params * w, params * g, params * o, activation_bytes(cfg, layout, first, last))
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best


# ---------------------------------------------------------------- layout search


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def _valid_tp(m: ModelConfig, tp: int) -> bool:
    return m.num_attention_heads % tp == 0 and m.query_groups % tp == 0


def _candidates(cfg: RunConfig, cluster: ClusterConfig, fixed_tp: int | None, fixed_pp: int | None):
    m = cfg.model
    max_gpus = cluster.nodes * cluster.gpus_per_node
    pps = [fixed_pp] if fixed_pp else [p for p in range(1, m.num_layers + 1) if m.num_layers % p == 0]
    tps = [fixed_tp] if fixed_tp else _powers_of_two(cluster.gpus_per_node)
    for pp in pps:
        for tp in tps:
            if _valid_tp(m, tp) and tp * pp <= max_gpus:
                yield tp, pp


def _accepts(cfg: RunConfig, **parallel) -> bool:
    """Does the run's config validate with these parallel settings?"""
    raw = cfg.model_dump(mode="json")
    raw["parallel"].update(parallel)
    try:
        RunConfig.model_validate(raw)
    except ValidationError:
        return False
    return True


def _nodes_for(cluster: ClusterConfig, tp: int, pp: int, requested: int | None) -> int:
    if requested is not None:
        return requested
    return max(1, math.ceil(tp * pp / cluster.gpus_per_node))


@dataclass(frozen=True)
class RunPlan:
    run_id: str
    scale: str
    arm: str
    layout: Layout
    memory: Memory
    engine: str
    zero_stage: int | None
    distributed_optimizer: bool | None
    steps: int
    tokens: int
    flops: float
    gpu_hours: float
    fits: bool
    reason: str | None = None

    def as_dict(self) -> dict:
        d = {
            "run_id": self.run_id,
            "scale": self.scale,
            "arm": self.arm,
            **asdict(self.layout),
            "gpus": self.layout.world_size,
            "engine": self.engine,
            "zero_stage": self.zero_stage,
            "distributed_optimizer": self.distributed_optimizer,
            "memory_gb": self.memory.as_gb(),
            "steps": self.steps,
            "tokens": self.tokens,
            "flops": self.flops,
            "gpu_hours": round(self.gpu_hours, 4),
            "fits": self.fits,
        }
        if self.reason:
            d["reason"] = self.reason
        return d


def plan_run(
    cfg: RunConfig,
    cluster: ClusterConfig,
    *,
    run_id: str,
    scale: str,
    arm: str,
    nodes: int | None = None,
    fixed_tp: int | None = None,
    fixed_pp: int | None = None,
    fixed_micro_batch: bool = False,
    sequence_parallel: bool | None = None,
    recompute_query: bool | None = None,
) -> RunPlan:
    """The first layout (smallest model parallelism, then largest micro-batch: `_micro_batches`)
    whose memory fits.
    sequence_parallel: True uses it wherever tp > 1 and the config accepts it (the schema knows
    which arms and engines can); None lets the planner turn it on where a tp > 1 layout fits only
    with it, before recompute_query (it moves no more data than the all-reduces it replaces).
    recompute_query: None lets the planner turn it on where the arm has a query MLP and a layout
    fits only with it, before halving the micro-batch (it costs one extra forward of that MLP)."""
    if nodes is not None and nodes > cluster.nodes:
        return _unfit(cfg, cluster, run_id, scale, arm, f"asks for {nodes} nodes, cluster {cluster.name} has {cluster.nodes}")
    fallback: tuple[Layout, Memory] | None = None
    for tp, pp in _candidates(cfg, cluster, fixed_tp, fixed_pp):
        n = _nodes_for(cluster, tp, pp, nodes)
        if n > cluster.nodes:
            continue
        world = n * cluster.gpus_per_node
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        sp_choices = _sequence_parallel_choices(cfg, sequence_parallel, tp, pp)
        for mbs in _micro_batches(cfg, dp, tp * pp > 1, fixed_micro_batch):
            choices = [(sp, rq) for rq in _recompute_query_choices(cfg, recompute_query) for sp in sp_choices]
            for sp, rq in choices:
                layout = Layout(
                    n, cluster.gpus_per_node, tp, pp, dp, mbs, _grad_accum(cfg, mbs, dp),
                    cfg.parallel.recompute, sp, rq,
                )
                mem = memory_per_device(cfg, layout)
                if mem.total <= cluster.usable_bytes:
                    return _plan(cfg, cluster, run_id, scale, arm, layout, mem, True)
                if fallback is None or mem.total < fallback[1].total:
                    fallback = (layout, mem)
    if fallback is None:
        return _unfit(cfg, cluster, run_id, scale, arm, "no tp x pp x dp layout divides the model and global batch")
    layout, mem = fallback
    reason = (
        f"needs {mem.total / GB:.1f} GiB per device at best (tp={layout.tp} pp={layout.pp} dp={layout.dp} "
        f"mbs={layout.micro_batch_size}), cluster {cluster.name} has {cluster.usable_bytes / GB:.1f} usable"
    )
    return _plan(cfg, cluster, run_id, scale, arm, layout, mem, False, reason)


def _grad_accum(cfg: RunConfig, micro_batch: int, dp: int) -> int:
    """Micro-batches per step on each DP rank."""
    return cfg.train.global_batch_size // (micro_batch * dp)


def _micro_batches(cfg: RunConfig, dp: int, model_parallel: bool, fixed: bool) -> list[int]:
    """Micro-batch sizes to try, largest first, each dividing a DP rank's share of the global batch.
    Under data parallelism alone (the small models) from the whole share down: fewer, larger
    micro-batches keep a GPU busy where many small ones leave it waiting on the host (H100, 124M: 48
    sequences at once gave linear 1.28x and nonlinear 1.47x the tokens/s of 12, docs/performance.md).
    With model parallelism from the config's micro-batch down: a pipeline's bubble shrinks with the
    micro-batches per step, and a model split over GPUs already runs large GEMMs. A pinned
    micro-batch (a sweep's parallel.micro_batch_size) is the only one tried."""
    t = cfg.train
    share, rest = divmod(t.global_batch_size, dp)
    if rest:
        return []
    if fixed:
        return [t.micro_batch_size] if share % t.micro_batch_size == 0 else []
    ceiling = t.micro_batch_size if model_parallel else share
    return [mbs for mbs in range(min(ceiling, share), 0, -1) if share % mbs == 0]


def _sequence_parallel_choices(cfg: RunConfig, requested: bool | None, tp: int, pp: int) -> list[bool]:
    """sequence_parallel settings to try at this tp x pp, in order: off where it cannot run (tp = 1,
    an engine or arm that refuses it), the requested one, the config's own, else off then on."""
    if tp == 1 or not _accepts(cfg, tp=tp, pp=pp, sequence_parallel=True):
        return [False]
    if requested is not None:
        return [requested]
    return [True] if cfg.parallel.sequence_parallel else [False, True]


def _recompute_query_choices(cfg: RunConfig, requested: bool | None) -> list[bool]:
    """recompute_query settings to try, in order: the requested one, else off then on where it helps."""
    if requested is not None:
        return [requested]
    if cfg.parallel.recompute_query or not arms.get(cfg.model.arm).recomputes_query(cfg.model, True):
        return [cfg.parallel.recompute_query]
    return [False, True]


def _plan(cfg, cluster, run_id, scale, arm, layout, mem, fits, reason=None) -> RunPlan:
    tokens = cfg.train.steps * cfg.train.global_batch_size * cfg.model.seq_length
    flops = float(flops_per_token(cfg.model)) * tokens
    gpu_hours = flops / (cluster.peak_tflops * 1e12 * cluster.assumed_mfu) / 3600
    t = cfg.train
    return RunPlan(
        run_id, scale, arm, layout, mem, t.engine,
        t.zero_stage if t.engine == "deepspeed" else None,
        t.distributed_optimizer if t.engine == "megatron" else None,
        t.steps, tokens, flops, gpu_hours, fits, reason,
    )


def _unfit(cfg, cluster, run_id, scale, arm, reason) -> RunPlan:
    layout = Layout(0, cluster.gpus_per_node, cfg.parallel.tp, cfg.parallel.pp, 0, cfg.train.micro_batch_size, 0,
                    cfg.parallel.recompute, cfg.parallel.sequence_parallel, cfg.parallel.recompute_query)
    return _plan(cfg, cluster, run_id, scale, arm, layout, Memory(0, 0, 0, 0), False, reason)


def apply_layout(cfg: RunConfig, layout: Layout, run_id: str, cluster: ClusterConfig) -> RunConfig:
    """The run's config with the planned tp/pp/micro-batch and the cluster's device, validated again.
    A GPU cluster's runs ask for CUDA (a node without it fails fast instead of training on the CPU)
    and know the device peak, so they log MFU."""
    raw = cfg.model_dump(mode="json")
    raw["parallel"].update(tp=layout.tp, pp=layout.pp, sequence_parallel=layout.sequence_parallel,
                           recompute_query=layout.recompute_query)
    raw["train"]["micro_batch_size"] = layout.micro_batch_size
    on_gpu = cluster.device == "gpu"
    if raw["runtime"]["device"] == "auto":
        raw["runtime"]["device"] = "cuda" if on_gpu else "cpu"
    if on_gpu and raw["train"]["device_peak_flops"] is None:
        raw["train"]["device_peak_flops"] = cluster.peak_tflops * 1e12
    return build_run_config(raw, f"sweep run {run_id}")


@dataclass(frozen=True)
class PlannedRun:
    spec: RunSpec
    plan: RunPlan
    cfg: RunConfig  # spec.cfg with the planned layout: what the job trains


def plan_sweep(sweep: SweepConfig, cluster: ClusterConfig, cli_overrides: Iterable[str] = ()) -> list[PlannedRun]:
    """Expand and plan every run. A run that cannot fit the cluster is a UsageError naming it."""
    return plan_specs(sweep, expand(sweep, cli_overrides), cluster)


def plan_specs(sweep: SweepConfig, specs: Iterable[RunSpec], cluster: ClusterConfig) -> list[PlannedRun]:
    """Plan these runs of the sweep (its parallel preferences); one that cannot fit is a UsageError."""
    prefs = sweep.parallel
    specs = list(specs)
    plans = []
    for spec in specs:
        plan = plan_run(
            spec.cfg, cluster, run_id=spec.run_id, scale=spec.scale, arm=spec.arm,
            nodes=prefs.nodes_for(spec.scale), fixed_tp=prefs.tp, fixed_pp=prefs.pp,
            fixed_micro_batch=prefs.micro_batch_size is not None, sequence_parallel=prefs.sequence_parallel,
            recompute_query=prefs.recompute_query,
        )
        if not plan.fits:
            raise UsageError(f"run {spec.run_id} cannot fit cluster {cluster.name}: {plan.reason}")
        plans.append(plan)
    plans = _one_micro_batch_per_layout(plans, [spec.cfg for spec in specs])
    return [PlannedRun(spec, plan, apply_layout(spec.cfg, plan.layout, spec.run_id, cluster))
            for spec, plan in zip(specs, plans)]


def _one_micro_batch_per_layout(plans: list[RunPlan], cfgs: list[RunConfig]) -> list[RunPlan]:
    """The runs of a scale that share a tp x pp x dp layout all train at the smallest micro-batch any
    of them was planned at, so that the arms' tokens/s compare like with like: the nonlinear arm's
    extra activations would otherwise leave it a smaller micro-batch than the others, and on a GPU
    a smaller one is slower per token. A smaller micro-batch fits wherever a larger one did."""
    def key(p: RunPlan) -> tuple:
        return p.scale, p.layout.tp, p.layout.pp, p.layout.dp

    smallest: dict[tuple, int] = {}
    for p in plans:
        smallest[key(p)] = min(smallest.get(key(p), p.layout.micro_batch_size), p.layout.micro_batch_size)
    out = []
    for p, cfg in zip(plans, cfgs):
        mbs = smallest[key(p)]
        if mbs != p.layout.micro_batch_size:
            layout = replace(p.layout, micro_batch_size=mbs,
                             grad_accum=_grad_accum(cfg, mbs, p.layout.dp))
            p = replace(p, layout=layout, memory=memory_per_device(cfg, layout))
        out.append(p)
    return out


def check_launchable(runs: Iterable[PlannedRun]) -> None:
    """What `train`'s preflight refuses about a planned layout, found at submit time instead of in a
    queued job: the world size must split into tp x pp x dp, the global batch into micro-batches
    of every DP rank, and the fixed validation set into DP ranks' micro-batches."""
    for run in runs:
        try:
            run.cfg.check_world(run.plan.layout.world_size)
        except ValueError as e:
            raise UsageError(f"run {run.spec.run_id}: layout: {e}") from None


def totals(plans: list[RunPlan]) -> dict:
    """Sums per scale and for the whole sweep."""

    def agg(ps: list[RunPlan]) -> dict:
        return {
            "runs": len(ps),
            "tokens": sum(p.tokens for p in ps),
            "flops": sum(p.flops for p in ps),
            "gpu_hours": round(sum(p.gpu_hours for p in ps), 4),
        }

    scales = list(dict.fromkeys(p.scale for p in plans))
    return {"per_scale": {s: agg([p for p in plans if p.scale == s]) for s in scales}, "sweep": agg(plans)}


# ---------------------------------------------------------------------------------------------
# the proxy learning-rate search, priced


def proxy_config(cfg: RunConfig, width: int) -> RunConfig:
    """The run at `width`: its depth, head dim, batch, sequence length and tokens kept, heads (and GQA
    groups) scaled with the width, under muP with `width` as the base (so its best learning rate is
    the one to use at the full width)."""
    m = cfg.model
    if width % m.head_dim or width >= m.hidden_size:
        raise UsageError(f"--lr-proxy {width}: must be a multiple of the head dim ({m.head_dim}) below "
                         f"hidden_size ({m.hidden_size}) of {cfg.name}")
    heads = width // m.head_dim
    raw = cfg.model_dump(mode="json")
    raw["model"].update(
        hidden_size=width, num_attention_heads=heads, kv_channels=m.head_dim,
        num_query_groups=None if m.num_query_groups is None else max(1, m.query_groups * heads // m.num_attention_heads),
        parametrization="mup", mup_base_hidden_size=width,
    )  # fmt: skip
    raw["name"] = f"{cfg.name}-proxy{width}"
    raw["variant"] = f"{cfg.arm_label}-proxy{width}"  # its own cell in the analysis, not the target's
    return build_run_config(raw, f"the {width}-wide proxy of {cfg.name}")


def proxy_search_cost(runs: list[PlannedRun], cluster: ClusterConfig, width: int) -> dict:
    """GPU-hours of the sweep's per-rung LR grid against the proxy strategy: per scale and arm, the
    grid on the `width`-wide proxy (one seed), then the target at eta* with every seed plus one seed at
    each neighbouring grid point to confirm the optimum."""
    groups: dict[tuple[str, str], list[PlannedRun]] = {}
    for r in runs:
        groups.setdefault((r.spec.scale, r.spec.arm), []).append(r)
    per_scale: dict[str, dict[str, float]] = {}
    for (scale, arm), group in groups.items():
        lrs, seeds = {r.spec.lr for r in group}, {r.spec.seed for r in group}
        proxy = plan_run(proxy_config(group[0].spec.cfg, width), cluster, run_id=f"{group[0].spec.run_id}-proxy",
                         scale=scale, arm=arm)  # fmt: skip
        if not proxy.fits:
            raise UsageError(f"--lr-proxy {width}: the proxy of {group[0].spec.run_id} cannot fit: {proxy.reason}")
        per_run = sum(r.plan.gpu_hours for r in group) / len(group)
        row = per_scale.setdefault(scale, {"grid": 0.0, "proxy": 0.0, "target": 0.0})
        row["grid"] += sum(r.plan.gpu_hours for r in group)
        row["proxy"] += len(lrs) * proxy.gpu_hours
        row["target"] += (len(seeds) + min(2, len(lrs) - 1)) * per_run
    total = {k: sum(row[k] for row in per_scale.values()) for k in ("grid", "proxy", "target")}
    strategy = total["proxy"] + total["target"]
    return {"width": width, "per_scale": per_scale, "grid_gpu_hours": total["grid"], "proxy_gpu_hours": total["proxy"],
            "target_gpu_hours": total["target"], "strategy_gpu_hours": strategy,
            "saving": total["grid"] / strategy if strategy else None}  # fmt: skip
