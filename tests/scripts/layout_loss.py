"""Rank script: the loss of reference weights loaded into a megatron GPT at a TP x PP layout (with
sequence parallelism when SP is `sp`), through megatron's pipeline schedule (forward and backward),
for each case; each case's model is also saved with dist_checkpointing to OUT's directory,
`<OUT stem>.ckpt/<case index>`, and this rank's gradients to `<OUT stem>.grads/<case index>/<rank>.pt`
(those of sequence-parallel parameters summed over TP, as megatron's finalize_model_grads does).
Usage: layout_loss.py TP PP SP OUT CASE... where SP is `sp` or `-` and a CASE is a model.arm,
optionally with overrides: `nonlinear|model.qk_norm=rms|...`."""

import json
import os
import sys
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from nlq_scale.config import load_run_config
from nlq_scale.config.schema import ParallelConfig
from nlq_scale.model.gpt import build_gpt, seed_init
from nlq_scale.model.reference import ReferenceGPT, load_into_megatron
from nlq_scale.runtime.device import Device
from nlq_scale.runtime.dist import distributed
from nlq_scale.train.engine_common import lm_loss, reduce_last_stage_mean
from tests.conftest import TINY_MODEL


def arm_loss(case: str, tp: str, pp: str, sp: str, checkpoint: Path, grads: Path) -> float:
    arm, *extra = case.split("|")
    layout = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.sequence_parallel={sp == 'sp'}"]
    cfg = load_run_config("124m", overrides=TINY_MODEL + [f"model.arm={arm}", *extra, *layout])
    seed_init(7)
    model = build_gpt(cfg.model, cfg.parallel, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    torch.manual_seed(0)
    load_into_megatron(model, ReferenceGPT(cfg.model))
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_length + 1))
    positions = torch.arange(cfg.model.seq_length).unsqueeze(0).expand(2, -1)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)

        def loss_func(logits):
            loss = lm_loss(logits, batch[:, 1:], 0.0)
            return loss, {"lm loss": loss.detach().clone()}

        return model(batch[:, :-1], positions, None), loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(tokens.split(2)),
        model=[model],
        num_microbatches=2,
        seq_length=cfg.model.seq_length,
        micro_batch_size=2,
        forward_only=False,
    )
    checkpoint.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(checkpoint))
    save_grads(model, grads / f"{os.environ['RANK']}.pt")
    return reduce_last_stage_mean(losses, Device(torch.device("cpu")))


def save_grads(model: torch.nn.Module, path: Path) -> None:
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({name: param.grad for name, param in model.named_parameters()}, path)


def main(tp: str, pp: str, sp: str, out: str, *cases: str) -> None:
    with distributed(ParallelConfig(tp=int(tp), pp=int(pp))):
        checkpoints, grads = Path(out).with_suffix(".ckpt"), Path(out).with_suffix(".grads")
        losses = {case: arm_loss(case, tp, pp, sp, checkpoints / str(i), grads / str(i)) for i, case in enumerate(cases)}
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
