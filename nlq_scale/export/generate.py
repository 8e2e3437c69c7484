"""Decoding with the harness's own megatron GPT (from a run directory) or with transformers (from
an export directory): greedy, or sampled with a temperature and top-k. Both keep a KV cache (the
harness path megatron-core's static inference context: the prompt in one forward, then one token
per forward); both stop at GPT-2's end-of-text token, as transformers' generate does. Greedy ids agree between the two; sampled ids are reproducible per
path and seed, but the two paths draw their random numbers differently."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nlq_scale.errors import UsageError, first_line


@dataclass(frozen=True)
class Sampling:
    """temperature None: greedy. top_k None: the whole vocabulary."""

    temperature: float | None = None
    top_k: int | None = None
    seed: int = 0

    def check(self) -> None:
        if self.temperature is not None and self.temperature <= 0:
            raise UsageError(f"--temperature {self.temperature}: must be > 0 (leave it out for greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"--top-k {self.top_k}: must be >= 1")


GREEDY = Sampling()


def _next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature is None:
        return int(logits.argmax())
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None:
        kth = logits.topk(min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def decode_harness(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eot: int, sampling: Sampling = GREEDY
) -> list[int]:
    """New token ids from a megatron GPTModel (TP = PP = 1). The query variants compute each
    token's query from that token alone, so megatron's cache of K and V is all they need."""
    from megatron.core.inference.contexts import StaticInferenceContext

    generator = torch.Generator().manual_seed(sampling.seed)
    cache = StaticInferenceContext(max_batch_size=1, max_sequence_length=len(prompt_ids) + max_new_tokens)
    ids, cached = list(prompt_ids), 0  # cached: tokens whose K/V the cache holds
    for _ in range(max_new_tokens):
        tokens = torch.tensor([ids[cached:]])
        logits = model(tokens, torch.arange(cached, len(ids)).unsqueeze(0), None, inference_context=cache,
                       runtime_gather_output=True)  # fmt: skip
        cache.increment_sequence_len_offset(tokens.shape[1])
        cache.enable_decode_mode()
        cached = len(ids)
        ids.append(_next_token(logits[0, -1], sampling, generator))
        if ids[-1] == eot:
            break
    return ids[len(prompt_ids) :]


def check_length(prompt_ids: list[int], max_new_tokens: int, seq_length: int) -> None:
    if not prompt_ids:
        raise UsageError("--prompt: encodes to no tokens")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    if len(prompt_ids) + max_new_tokens > seq_length:
        raise UsageError(
            f"--max-new-tokens {max_new_tokens}: prompt ({len(prompt_ids)} tokens) + new tokens exceed the "
            f"model's context of {seq_length}"
        )


def from_run(run_dir: Path, step: int | None, prompt: str, max_new_tokens: int, sampling: Sampling = GREEDY) -> dict:
    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.data.tokenizer import gpt2_tokenizer
    from nlq_scale.export.checkpoint import find_checkpoint, load_harness_model
    from nlq_scale.runtime.dist import distributed

    ckpt = find_checkpoint(run_dir, step)
    encoding = gpt2_tokenizer().encoding
    prompt_ids = encoding.encode(prompt, allowed_special=set(), disallowed_special=())
    check_length(prompt_ids, max_new_tokens, ckpt.cfg.model.seq_length)
    with distributed(ParallelConfig(), device="cpu"):
        model = load_harness_model(ckpt)
        output_ids = decode_harness(model, prompt_ids, max_new_tokens, encoding.eot_token, sampling)
    return {"prompt_ids": prompt_ids, "output_ids": output_ids, "text": encoding.decode(output_ids)}


@torch.no_grad()
def from_export(export_dir: Path, prompt: str, max_new_tokens: int, sampling: Sampling = GREEDY) -> dict:
    tokenizer, model = _load_export(export_dir)
    prompt_ids = tokenizer(prompt)["input_ids"]
    check_length(prompt_ids, max_new_tokens, model.config.max_position_embeddings)
    torch.manual_seed(sampling.seed)
    sample = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    if sampling.temperature is not None:
        sample = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": None}
    out = model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, **sample,
    )  # fmt: skip
    output_ids = out[0, len(prompt_ids) :].tolist()
    return {"prompt_ids": prompt_ids, "output_ids": output_ids, "text": tokenizer.decode(output_ids)}


def _load_export(export_dir: Path):
    """(tokenizer, model) of a transformers directory; a directory transformers cannot load (a
    config.json of no known model type, missing weights or tokenizer files) is one line naming it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(export_dir)
        model = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True, torch_dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{export_dir}: not a transformers export this can load ({first_line(e)[:200]})") from None
    return tokenizer, model.eval()
