"""Expected training MFU of a scale and arm on a GPU, on paper (docs/performance.md).

A token's training step is priced as three parts that do not overlap: its matmul FLOPs at a
fraction of the GPU's bf16 peak that large GEMMs reach, the causal half of its attention FLOPs at a
lower fraction (flash attention), and its memory-bound elementwise passes at the HBM bandwidth. The
elementwise passes are the block's norms, residual adds and MLP activation, the arm's query path
(each element it keeps for backward: `Arm.activation_elements`) and the fp32 softmax over the
vocabulary. Each elementwise element is read and written in forward and read twice and written once
in backward: 5 accesses of 2 bytes (bf16). MFU is the accounting's FLOPs per token
(`flops_per_token`, what `mfu` logs on a GPU) over the time that gives, at the bf16 peak.

What it leaves out, to be measured on a GPU: kernel launch and Python overheads (they weigh most
at 124M), communication (TP all-reduces, DP gradient reduction), the optimizer step and pipeline
bubbles. It is a model of where the query path's cost goes as width grows, not a prediction of
absolute MFU; docs/tested.md records what a GPU run measured.

    python -m nlq_scale.model.roofline    # the table in docs/performance.md
"""

from __future__ import annotations

from dataclasses import dataclass

from nlq_scale import arms
from nlq_scale.config.schema import ModelConfig
from nlq_scale.model.accounting import ffn_hidden_size, flops_per_token

MATMUL_EFFICIENCY = 0.7  # of the bf16 peak, for the large GEMMs of a Megatron layer (TE, bf16)
ATTENTION_EFFICIENCY = 0.5  # flash attention's share of the peak
BYTES_PER_ELEMENT = 2 * 5  # bf16; written and read in forward, read twice and written in backward
SOFTMAX_BYTES_PER_LOGIT = 2 + 4 * 3  # bf16 logits written; fp32 softmax written, read, its gradient written
SCALES = ("124m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b")


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense
    hbm_tb_per_s: float


H100 = Gpu("H100 SXM", 989.0, 3.35)


def elementwise_bytes_per_token(m: ModelConfig) -> float:
    """Memory-bound traffic per token: every layer's norms, residual adds, activation and query path,
    then the final norm and the softmax over the (padded) vocabulary."""
    d = m.hidden_size
    replicated, split = arms.get(m.arm).activation_elements(m, 1)
    per_layer = 2 * d + 2 * d + ffn_hidden_size(m) + replicated + split  # 2 norms, 2 residual adds, act
    return (m.num_layers * per_layer + d) * BYTES_PER_ELEMENT + m.padded_vocab_size * SOFTMAX_BYTES_PER_LOGIT


def attention_flops_per_token(m: ModelConfig) -> float:
    return 12 * m.num_layers * m.seq_length * m.num_attention_heads * m.head_dim


def seconds_per_token(m: ModelConfig, gpu: Gpu = H100) -> float:
    peak = gpu.bf16_tflops * 1e12
    attention = attention_flops_per_token(m)
    matmul = flops_per_token(m) - attention
    return (
        matmul / (peak * MATMUL_EFFICIENCY)
        + attention / 2 / (peak * ATTENTION_EFFICIENCY)  # causal: half the score matrix is computed
        + elementwise_bytes_per_token(m) / (gpu.hbm_tb_per_s * 1e12)
    )


def expected_mfu(m: ModelConfig, gpu: Gpu = H100) -> float:
    return flops_per_token(m) / (seconds_per_token(m, gpu) * gpu.bf16_tflops * 1e12)


def table(gpu: Gpu = H100, scales: tuple[str, ...] = SCALES) -> str:
    """Markdown: expected MFU per scale and arm, and each arm's tokens/s over the baseline's."""
    from nlq_scale.config.load import load_run_config

    names, base = arms.names(), arms.baseline().name
    lines = [f"| scale | {' | '.join(names)} | " + " | ".join(f"{a}/{base} tokens/s" for a in names if a != base) + " |",
             "|---" * (2 * len(names)) + "|"]  # fmt: skip
    for scale in scales:
        models = {a: load_run_config(scale, a).model for a in names}
        mfu = [f"{expected_mfu(models[a], gpu):.3f}" for a in names]
        speed = [f"{seconds_per_token(models[base], gpu) / seconds_per_token(models[a], gpu):.3f}"
                 for a in names if a != base]  # fmt: skip
        lines.append(f"| {scale} | {' | '.join(mfu)} | {' | '.join(speed)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
