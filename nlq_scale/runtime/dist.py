"""torch.distributed + megatron parallel_state from whatever launched us: torchrun (or submitit's
TorchDistributedEnvironment export), a bare `srun`, or nothing (one process).
gloo on CPU, nccl on GPU."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from nlq_scale.config.schema import ParallelConfig
from nlq_scale.runtime import cpu_shim
from nlq_scale.runtime.device import Device, resolve_device
from nlq_scale.runtime.environ import environment


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    # The launcher already serves the rendezvous store at master_addr:master_port (launch.hosted_store),
    # so rank 0 joins it as a client instead of binding the port itself.
    store_hosted: bool = False

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


@dataclass(frozen=True)
class World:
    """The initialized distributed world as this process sees it: its size and parallel split,
    this process's ranks in it, and its device. (A run's planned split over nodes and devices,
    before any process starts, is cluster.plan.Layout.)"""

    world_size: int
    num_nodes: int
    tp: int
    pp: int
    ep: int
    dp: int
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: Device


STORE_HOSTED = "NLQ_SCALE_STORE_HOSTED"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_slurm_host(nodelist: str) -> str:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


# Below Linux's default ephemeral range (32768-60999), where srun's I/O sockets and every outgoing
# connection on the node take their ports: a rendezvous port there is sometimes taken (EADDRINUSE).
JOB_PORTS = range(20000, 32000)


def job_master_port(job_id: str) -> int:
    """The rendezvous port every task of a job derives alike from the job id: nothing to agree on."""
    return JOB_PORTS.start + zlib.crc32(job_id.encode()) % len(JOB_PORTS)


def detect_env() -> DistEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, submitit export, our --nproc launcher
        world = int(env["WORLD_SIZE"])
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            store_hosted=env.get(STORE_HOSTED) == "1",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # plain srun, one task per rank
        job = env.get("SLURM_JOB_ID", "0")
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"]).split("(")[0]),
            master_addr=_first_slurm_host(env["SLURM_JOB_NODELIST"]),
            master_port=job_master_port(job),
        )
    return DistEnv(0, 1, 0, 1, "127.0.0.1", free_port())


# What a launcher (torchrun, our --nproc launcher) sets and export_env writes.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env_restored(hidden: bool = False) -> contextlib.AbstractContextManager[None]:
    """LAUNCH_ENV as it was on entry, again on exit; `hidden` removes it inside the block."""
    return environment({name: None if hidden else os.environ.get(name) for name in LAUNCH_ENV})


def export_env(env: DistEnv) -> None:
    """Make the env visible to libraries that read it (megatron checkpointing, DeepSpeed)."""
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )


def _rendezvous(env: DistEnv, timeout: timedelta) -> dict:
    if env.world_size == 1:  # no rendezvous: an in-memory store avoids racing other jobs for a port
        return {"store": dist.HashStore()}
    if env.store_hosted:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        return {"store": store}
    return {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}


def init_distributed(env: DistEnv, parallel: ParallelConfig, device: str = "auto", timeout_min: int = 30) -> World:
    """`device` is runtime.device; it is resolved (and CUDA checked) before anything else starts."""
    from megatron.core import parallel_state as ps

    compute = resolve_device(device, env.local_rank)
    cpu_shim.apply()
    export_env(env)
    backend = compute.backend
    if compute.is_cuda:
        torch.cuda.set_device(compute.torch_device)
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_min)
        dist.init_process_group(
            backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **_rendezvous(env, timeout)
        )
    if env.world_size % (parallel.tp * parallel.pp):
        raise ValueError(f"world size {env.world_size} not divisible by tp*pp = {parallel.tp * parallel.pp}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        distributed_timeout_minutes=timeout_min,
    )
    return World(
        world_size=env.world_size,
        num_nodes=env.num_nodes,
        tp=parallel.tp,
        pp=parallel.pp,
        ep=parallel.ep,
        dp=ps.get_data_parallel_world_size(),
        rank=env.rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=compute,
    )


def teardown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(parallel: ParallelConfig, env: DistEnv | None = None, device: str = "auto") -> Iterator[World]:
    """Init torch.distributed + megatron parallel state for the duration of the block. The
    environment export_env wrote goes with them: a one-process block's MASTER_PORT was free only
    when picked, and a library run after the block (accelerate, inside lm-eval) would rendezvous on it."""
    with launch_env_restored():
        world = init_distributed(env or detect_env(), parallel, device)
        try:
            yield world
        finally:
            teardown()
