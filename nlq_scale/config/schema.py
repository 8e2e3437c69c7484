"""Typed run configuration. Every part of the harness reads these models, never raw dicts.

Names follow megatron-core where one exists (docs/configuration.md lists every key).
Unknown keys are errors (``extra="forbid"``) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, create_model, field_validator, model_validator

from nlq_scale import arms
from nlq_scale.model.accounting import matched_ffn_hidden_size
from nlq_scale.strict import Strict

ARMS = arms.names()
ArmName = Literal[ARMS]  # the registered arms (nlq_scale.arms)
QKNorm = Literal["none", "learned", "rms"]


class MoEConfig(Strict):
    num_experts: PositiveInt | None = Field(None, description="None = dense MLP")
    router_topk: PositiveInt = Field(2, description="experts per token")
    aux_loss_coeff: float = Field(1e-2, ge=0.0, description="load-balancing loss weight")


class _ModelFields(Strict):
    """model.*: the shape and the arm; ModelConfig adds each arm's option section (see below)."""

    arm: ArmName = Field(
        arms.baseline().name, description="query arm: " + "; ".join(f"{a.name}: {a.summary}" for a in arms.all_arms())
    )
    num_layers: PositiveInt = Field(12, description="transformer layers")
    hidden_size: PositiveInt = Field(768, description="d_model")
    num_attention_heads: PositiveInt = Field(12, description="query heads")
    num_query_groups: PositiveInt | None = Field(None, description="GQA groups; None = one per head")
    kv_channels: PositiveInt | None = Field(None, description="head dim; default hidden/heads")
    mlp_ratio: PositiveFloat = Field(4.0, description="MLP width / hidden size")
    ffn_hidden_size: PositiveInt | None = Field(
        None, description="MLP width; None = mlp_ratio x hidden_size. With match_params_of it is solved when the "
        "config is loaded (a given value must equal the solution)"
    )
    match_params_of: ArmName | None = Field(
        None, description="baseline arm only: solve ffn_hidden_size so non-embedding params match this arm"
    )
    seq_length: PositiveInt = Field(1024, description="context length (tokens per sequence)")
    vocab_size: PositiveInt = Field(50257, description="tokenizer vocabulary (GPT-2 BPE)")
    make_vocab_size_divisible_by: PositiveInt = Field(128, description="pad the embedding rows (50257 -> 50304)")
    position_embedding: Literal["learned_absolute", "rope"] = Field("learned_absolute", description="GPT-2 learned positions or rotary")
    rotary_base: PositiveInt = Field(10000, description="RoPE base")
    tie_embeddings: bool = Field(True, description="share input embedding and output layer")
    add_bias_linear: bool = Field(False, description="biases in linear layers (the papers: none)")
    normalization: Literal["LayerNorm", "RMSNorm"] = Field("LayerNorm", description="block norms")
    norm_bias: bool = Field(True, description="LayerNorms with a bias (false: every LayerNorm without, as nanoGPT bias=False)")
    qk_norm: QKNorm = Field(
        "none",
        description="per-head norm of the final query and key: learned (megatron's q/k LayerNorm), "
        "rms (parameter-free RMS, eps 1e-6); true/false mean learned/none",
    )
    init_std: PositiveFloat = Field(0.02, description="weight init std (output layers scaled by 1/sqrt(2L))")
    parametrization: Literal["standard", "mup"] = Field(
        "standard",
        description="mup: muP (Adam, Table 8 form) relative to mup_base_hidden_size, so a learning rate tuned "
        "at the base width transfers (docs/mup.md)",
    )
    mup_base_hidden_size: PositiveInt | None = Field(
        None, description="mup: the width whose init and learning rates this model keeps (width multiplier = hidden_size / this)"
    )
    mup_base_head_dim: PositiveInt | None = Field(
        None, description="mup: the base head dim; set when head dim grows with width (attention scale ~ 1/head_dim)"
    )
    softmax_scale: PositiveFloat | None = Field(
        None, description="None = the arm's default (1/sqrt(d_k); identity 1/(2 sqrt(d_k)))"
    )
    moe: MoEConfig = MoEConfig()
    transformer_impl: Literal["local", "transformer_engine"] = Field(
        "local", description="transformer_engine needs a GPU with TE installed (untested on CPU)"
    )
    core_attention: Literal["auto", "sdpa", "stock"] = Field(
        "auto",
        description="sdpa: softmax(qk^T)v through torch's scaled_dot_product_attention (its fused kernels on CPU and "
        "GPU; no s x s probabilities kept for backward), transformer_impl=local only; stock: the layer spec's own "
        "(megatron's unfused attention, or Transformer Engine's); auto: sdpa with transformer_impl=local, stock with "
        "transformer_engine (docs/performance.md)",
    )
    bf16: bool = Field(False, description="bf16 parameters/compute (GPU; CPU works but is slow)")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @field_validator("qk_norm", mode="before")
    @classmethod
    def _qk_norm_bool(cls, v: object) -> object:
        return {True: "learned", False: "none"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("core_attention", mode="before")
    @classmethod
    def _core_attention_old_name(cls, v: object) -> object:
        return "stock" if v == "default" else v  # its name in configs written before auto existed

    @model_validator(mode="after")
    def _shapes(self) -> _ModelFields:
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"num_query_groups ({self.query_groups}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); set kv_channels"
            )
        arms.get(self.arm).check(self)
        baseline = arms.baseline().name
        if self.match_params_of is not None and self.arm != baseline:
            raise ValueError(f"match_params_of is only for the {baseline} arm (a parameter-matched control)")
        if self.match_params_of is not None:
            self._solve_matched_width()
        if not self.norm_bias and self.transformer_impl != "local":
            raise ValueError("norm_bias=false needs transformer_impl=local (TE fuses its biased LayerNorm)")
        if self.core_attention == "sdpa" and self.transformer_impl != "local":
            raise ValueError("core_attention=sdpa needs transformer_impl=local (Transformer Engine brings its own fused attention)")
        if self.core_attention == "auto":  # resolved once, past validate_assignment (as _solve_matched_width)
            self.__dict__["core_attention"] = "sdpa" if self.transformer_impl == "local" else "stock"
        if self.parametrization == "mup" and self.mup_base_hidden_size is None:
            raise ValueError("parametrization=mup needs mup_base_hidden_size (the width the learning rate was tuned at)")
        if self.moe.num_experts is not None and self.add_bias_linear:
            raise ValueError("moe with add_bias_linear=true is unsupported (megatron in-place add on a view)")
        return self

    def _solve_matched_width(self) -> None:
        """Resolve match_params_of once, here at the edge, into the concrete MLP width every part
        then reads. Written past validate_assignment, which would re-enter this validator."""
        solved = matched_ffn_hidden_size(self)
        if self.ffn_hidden_size is None:
            self.__dict__["ffn_hidden_size"] = solved
            self.__pydantic_fields_set__.add("ffn_hidden_size")
        elif self.ffn_hidden_size != solved:
            raise ValueError(
                f"ffn_hidden_size={self.ffn_hidden_size} does not match the parameters of {self.match_params_of} "
                f"(solved: {solved}); leave it unset with match_params_of"
            )


# The arms' option sections (model.nlq, model.preproj, ...) come from the registry.
ModelConfig = create_model(
    "ModelConfig",
    __base__=_ModelFields,
    __module__=__name__,
    **{a.options_key: (a.options, a.options()) for a in arms.all_arms() if a.options is not None},
)


class ParallelConfig(Strict):
    tp: PositiveInt = Field(1, description="tensor-parallel size")
    pp: PositiveInt = Field(1, description="pipeline-parallel size")
    ep: PositiveInt = Field(1, description="expert-parallel size (MoE)")
    sequence_parallel: bool = Field(False, description="megatron sequence parallelism (needs tp > 1)")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="activation recomputation (megatron recompute_granularity); the planner assumes it"
    )
    recompute_query: bool = Field(
        False,
        description="keep only the input and output of the arm's query MLP and recompute the rest in backward "
        "(arms with one: nonlinear, nonlinear-ph, preproj; no effect on the others)",
    )
    compile_query: bool = Field(
        False,
        description="compile the norms and elementwise work around the arm's query MLP with torch.compile "
        "(fused kernels; the same function, other rounding; arms with one: nonlinear, nonlinear-ph, preproj)",
    )
    # Kept beside cuda_graph_impl: it has run on an H100 (bit-exact, 1.30x the eager nonlinear arm there) and its
    # CPU stand-in runs in the tests, where megatron's graphs have not run on a GPU here yet.
    graph_query: bool = Field(
        False,
        description="run the arm's query module as two CUDA graphs, forward and backward, captured at its first "
        "training call (one host call each instead of ~40 kernel launches; tp=pp=1, no recompute, megatron engine; "
        "on the CPU the same buffers without graphs; arms with a query module: identity, nonlinear, nonlinear-ph, residual)",
    )
    cuda_graph_impl: Literal["none", "local", "full_iteration"] = Field(
        "none",
        description="megatron-core's CUDA graphs, for shapes where the GPU waits on the host (megatron engine, CUDA "
        "only): local captures each transformer layer's forward and backward, the arm's query module inside it, at "
        "the end of the first training step; full_iteration captures a training step's whole forward-backward after "
        "3 eager steps; the optimizer step and validation stay eager. Not yet run on a GPU (docs/performance.md)",
    )


class StreamConfig(Strict):
    path: str = Field(description="prepared dataset dir")
    proportion: PositiveFloat = Field(description="share of samples from this dataset")


# A validation size given in tokens becomes whole blocks of this many sequences, so that the usual
# power-of-two data-parallel x micro-batch layouts divide it.
VAL_BLOCK_SEQUENCES = 16


def val_sequences_for(tokens: int, seq_length: int) -> int:
    """Sequences of seq_length holding at least `tokens`, rounded up to whole VAL_BLOCK_SEQUENCES blocks."""
    return math.ceil(tokens / (seq_length * VAL_BLOCK_SEQUENCES)) * VAL_BLOCK_SEQUENCES


class ValidationSetConfig(Strict):
    """A further validation set, logged as val/<name>/loss: the val split of a prepared dataset."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="its metric is val/<name>/loss")
    path: str = Field(description="prepared dataset dir (its val split is used)")
    tokens: PositiveInt | None = Field(None, description="size in tokens (sets sequences, as data.val_tokens)")
    sequences: PositiveInt | None = Field(None, description="size in sequences (set by tokens when given)")


class DataConfig(Strict):
    path: str | None = Field(None, description="prepared MDS dataset dir (nlq-scale prepare-data)")
    streams: list[StreamConfig] | None = Field(None, description="mixture of prepared datasets")
    seed: int = Field(0, description="data seed: shuffle order, shared by every arm of a sweep")
    shuffle_algo: Literal["py1e", "py1br", "py1b"] = Field(
        "py1e", description="no padding algorithms only (py1s/py2s pad epochs with duplicates)"
    )
    num_canonical_nodes: PositiveInt = Field(
        1, description="fixed so the global batch at step k is the same for any world size"
    )
    num_workers: int = Field(0, ge=0, description="DataLoader workers per data-parallel rank")
    val_sequences: PositiveInt = Field(64, description="fixed validation set size (sequences); set by val_tokens when given")
    val_tokens: PositiveInt | None = Field(
        None, description="fixed validation set size in tokens: val_sequences = whole 16-sequence blocks holding it"
    )
    validation: list[ValidationSetConfig] = Field(
        [], description="further named validation sets (e.g. each Pile subset), each logged as val/<name>/loss"
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.path is not None and self.streams is not None:
            raise ValueError("give data.path or data.streams, not both")
        names = [v.name for v in self.validation]
        if len(set(names)) != len(names):
            raise ValueError(f"data.validation: names must differ, got {names}")
        return self

    def val_sets(self) -> list[tuple[str, str, int]]:
        """(metric, config field, sequences) per validation set: val/loss for the data's own val
        split, then the named sets."""
        named = [(f"val/{v.name}/loss", f"data.validation[{i}].sequences", v.sequences)
                 for i, v in enumerate(self.validation)]  # fmt: skip
        return [("val/loss", "data.val_sequences", self.val_sequences), *named]


class DivergenceConfig(Strict):
    margin: PositiveFloat = Field(0.5, description="val loss above its best by this much ...")
    patience: PositiveInt = Field(2, description="... for this many evals in a row -> diverged")


class TrainConfig(Strict):
    engine: Literal["megatron", "deepspeed"] = Field(
        "megatron", description="megatron (DDP + distributed optimizer, TP/PP/EP) or deepspeed (ZeRO 0-3, PP=1)"
    )
    distributed_optimizer: bool = Field(True, description="megatron engine: shard optimizer state over DP")
    zero_stage: int = Field(1, ge=0, le=3, description="deepspeed engine: ZeRO stage")
    steps: PositiveInt = Field(1000, description="optimizer steps (the sweep derives it from its horizon)")
    global_batch_size: PositiveInt = Field(480, description="sequences per optimizer step")
    micro_batch_size: PositiveInt = Field(8, description="sequences per forward/backward; grad-accum fills the global batch")
    lr: PositiveFloat = Field(6e-4, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="min lr = lr * min_lr_ratio")
    lr_schedule: Literal["cosine", "linear", "wsd"] = Field("cosine", description="decay after warmup: cosine, linear to the floor, warmup-stable-decay")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    wsd_decay_fraction: float = Field(0.2, gt=0.0, le=1.0, description="wsd: final fraction that decays")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW decay on >=2-D weights only")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="AdamW beta2")
    eps: PositiveFloat = Field(1e-8, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0.0, description="0 = off")
    z_loss: float = Field(0.0, ge=0.0, description="weight of mean(logsumexp(logits)^2) (PaLM z-loss)")
    eval_every: PositiveInt = Field(100, description="validation every N steps (and at the end)")
    log_every: PositiveInt = Field(10, description="progress line every N steps (metrics.jsonl gets every step)")
    device_peak_flops: PositiveFloat | None = Field(None, description="per device; enables mfu")
    divergence: DivergenceConfig = DivergenceConfig()

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps})")
        return self


class CheckpointConfig(Strict):
    every: int = Field(0, ge=0, description="save every N steps (0 = only at the end and on signals)")
    keep: PositiveInt = Field(2, description="newest complete checkpoints kept")
    keep_every: int = Field(0, ge=0, description="also keep every checkpoint whose step is a multiple of this (0 = none)")
    async_save: bool = Field(
        False,
        description="megatron engine: write the periodic checkpoints in the background while training goes on "
        "(completed at a later step; the final and preemption saves stay synchronous)",
    )
    async_writer: Literal["auto", "thread", "process"] = Field(
        "auto",
        description="where a background save writes: a thread of the training process (shares its interpreter "
        "lock) or a forked process (host pages training writes are copied while it lives); auto: the process on "
        "CUDA, the thread on the CPU",
    )


class LoggingConfig(Strict):
    wandb: bool = Field(True, description="mirror metrics to W&B (metrics.jsonl is the source of truth)")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="offline keeps the run in <run dir>/wandb; `wandb sync` later")
    wandb_project: str = Field("nlq-scale", description="W&B project")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user)")
    tags: list[str] = Field([], description="extra W&B tags (arm, scale, seed, lr are added)")
    profile_steps: tuple[PositiveInt, PositiveInt] | None = Field(
        None,
        description="[first, last]: profile these training steps (1-based) with torch.profiler; every rank writes "
        "a summary of where the time went (device busy fraction, kernels, syncs, top ops) to <run dir>/profile, "
        "rank 0 also the trace",
    )

    @field_validator("profile_steps")
    @classmethod
    def _ordered(cls, steps: tuple[int, int] | None) -> tuple[int, int] | None:
        if steps is not None and steps[0] > steps[1]:
            raise ValueError(f"[first, last] with first <= last, got {list(steps)}")
        return steps


class RuntimeConfig(Strict):
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="compute device: cuda:LOCAL_RANK + NCCL, or cpu + gloo; auto = CUDA when available"
    )
    check_device: bool = Field(
        False,
        description="CPU only: treat tensors made without an explicit device as host tensors and fail on any "
        "host/device mix or host tensor in a collective, as CUDA would (a placement check for CI)",
    )
    deterministic: bool = Field(
        True,
        description="CUDA: deterministic kernels (torch.use_deterministic_algorithms, a fixed cuBLAS workspace, "
        "megatron's deterministic_mode), so a resumed run repeats the uninterrupted one bit for bit; false is "
        "faster and a resume then matches only to rounding. The CPU is deterministic either way",
    )
    cpu_allocator: Literal["auto", "system"] = Field(
        "auto",
        description="host allocator of the rank processes: auto preloads tcmalloc where it is installed (Debian's "
        "libtcmalloc-minimal4), which reuses freed activation memory where glibc's malloc returns it to the OS and "
        "faults it in again at every step; system keeps glibc's. The `--nproc` ranks start on it; `nlq-scale train` "
        "in a process of its own and a submitted job's task restart themselves on it before importing torch; a run "
        "called in-process keeps the allocator its process started with (LD_PRELOAD)",
    )


def _sequences_from_tokens(section: Strict, key: str, tokens: int | None, seq_length: int) -> None:
    """section.<key> (sequences) from a size in tokens, when one is given: the tokens decide, so a
    scale's sequence count gives way to a size in tokens set over it."""
    if tokens is None:
        return
    section.__dict__[key] = val_sequences_for(tokens, seq_length)
    section.__pydantic_fields_set__.add(key)


def _refuse(field: str, refused: dict[str, bool]) -> None:
    """One line naming `field` and every setting in `refused` (description: is set) it cannot run with."""
    if any(refused.values()):
        raise ValueError(f"{field}: unsupported with {', '.join(k for k, v in refused.items() if v)}")


class RunConfig(Strict):
    name: str | None = Field(None, description="run id (stable per sweep point)")
    sweep: str | None = Field(None, description="sweep name; the W&B group")
    scale: str | None = Field(None, description="ladder scale this run came from")
    variant: str | None = Field(
        None, description="the arm as configs/arms names it (e.g. linear-mlp4.75); analysis groups by it"
    )
    seed: int = Field(1234, description="model init seed")
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="after")
    def _layout(self) -> RunConfig:
        m, p = self.model, self.parallel
        if m.num_attention_heads % p.tp:
            raise ValueError(f"num_attention_heads ({m.num_attention_heads}) not divisible by parallel.tp ({p.tp})")
        if m.query_groups % p.tp:
            raise ValueError(f"num_query_groups ({m.query_groups}) not divisible by parallel.tp ({p.tp})")
        if m.num_layers % p.pp:
            raise ValueError(f"num_layers ({m.num_layers}) not divisible by parallel.pp ({p.pp})")
        if p.ep > 1 and (m.moe.num_experts is None or m.moe.num_experts % p.ep):
            raise ValueError(f"parallel.ep ({p.ep}) must divide model.moe.num_experts ({m.moe.num_experts})")
        if p.sequence_parallel and (p.tp == 1 or not arms.get(m.arm).sequence_parallel):
            raise ValueError(
                f"parallel.sequence_parallel needs tp > 1 and an arm whose query path supports it (not {m.arm}: "
                "its Arm.sequence_parallel is False)"
            )
        if self.runtime.check_device and self.runtime.device == "cuda":
            raise ValueError("runtime.check_device emulates a GPU on the CPU: it needs runtime.device cpu or auto")
        if self.train.engine == "deepspeed" and p.pp > 1:
            raise ValueError("train.engine=deepspeed supports parallel.pp=1 only (use the megatron engine for PP)")
        if self.train.engine == "deepspeed" and p.ep > 1:
            raise ValueError("parallel.ep: must be 1 with train.engine=deepspeed (it cannot reduce megatron expert grads)")
        if self.train.engine == "deepspeed" and p.sequence_parallel:
            raise ValueError("parallel.sequence_parallel: unsupported with train.engine=deepspeed "
                             "(norm grads need megatron's TP reduction)")  # fmt: skip
        if self.train.engine == "deepspeed" and self.checkpoint.async_save:
            raise ValueError("checkpoint.async_save needs train.engine=megatron (the DeepSpeed engine saves synchronously)")
        if p.graph_query:
            self._graphable()
        if p.cuda_graph_impl != "none":
            self._cuda_graphable()
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) not divisible by "
                f"train.micro_batch_size ({self.train.micro_batch_size})"
            )
        self._solve_validation_sizes()
        return self

    def _graphable(self) -> None:
        """parallel.graph_query keeps one micro-batch in static buffers and replays no collective or hook."""
        p = self.parallel
        refused = {
            "parallel.tp > 1 (W2's all-reduce)": p.tp > 1,
            "parallel.pp > 1 (several micro-batches in flight)": p.pp > 1,
            f"parallel.recompute={p.recompute}": p.recompute != "none",
            "parallel.recompute_query": p.recompute_query,
            "parallel.compile_query": p.compile_query,
            "train.engine=deepspeed (ZeRO gathers parameters in module hooks)": self.train.engine == "deepspeed",
        }
        _refuse("parallel.graph_query", refused)

    def _cuda_graphable(self) -> None:
        """parallel.cuda_graph_impl: megatron captures CUDA kernels in its own schedule; what it refuses, or what
        would sync with the host inside a capture, is refused here. runtime.device=auto on a host without CUDA
        is refused when the engine starts."""
        p, impl = self.parallel, self.parallel.cuda_graph_impl
        refused = {
            "runtime.device=cpu (graphs capture CUDA kernels)": self.runtime.device == "cpu",
            "runtime.check_device (a CPU run)": self.runtime.check_device,
            "train.engine=deepspeed (megatron's schedule runs the graphs)": self.train.engine == "deepspeed",
            "parallel.graph_query (a graph inside megatron's)": p.graph_query,
            "parallel.recompute=full (megatron: with full_iteration only)": impl == "local" and p.recompute == "full",
            "model.moe.num_experts (the token dispatch syncs with the host)": self.model.moe.num_experts is not None,
        }
        _refuse(f"parallel.cuda_graph_impl={impl}", refused)

    def _solve_validation_sizes(self) -> None:
        """Sizes given in tokens become sequences once, here (written past validate_assignment, as
        ModelConfig's matched width)."""
        d, seq = self.data, self.model.seq_length
        _sequences_from_tokens(d, "val_sequences", d.val_tokens, seq)
        for i, v in enumerate(d.validation):
            if v.tokens is None and v.sequences is None:
                raise ValueError(f"data.validation[{i}] ({v.name}): give tokens or sequences")
            _sequences_from_tokens(v, "sequences", v.tokens, seq)

    @property
    def arm_label(self) -> str:
        return self.variant or self.model.arm

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.parallel.tp * self.parallel.pp
        if world_size % mp:
            raise ValueError(f"world size {world_size} not divisible by tp*pp = {mp}")
        return world_size // mp

    def grad_accum_steps(self, world_size: int) -> int:
        dp = self.data_parallel_size(world_size)
        per_step = self.train.micro_batch_size * dp
        if self.train.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) not divisible by "
                f"micro_batch_size*dp ({per_step})"
            )
        return self.train.global_batch_size // per_step

    def check_world(self, world_size: int) -> None:
        """What a launch at `world_size` ranks needs (ValueError otherwise): tp x pp x dp ranks, the
        global batch in micro-batches of every DP rank, every validation set in equal DP shares (each
        evaluated in micro-batches that divide its share: engine_common.eval_micro_batch)."""
        dp = self.data_parallel_size(world_size)
        self.grad_accum_steps(world_size)
        for _, field, sequences in self.data.val_sets():
            if sequences % dp:
                raise ValueError(f"{field} ({sequences}) must be a multiple of the data-parallel size ({dp})")
