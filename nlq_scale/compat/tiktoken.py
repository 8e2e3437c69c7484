"""tiktoken beyond its public API: building GPT-2's encoding from local files. `tiktoken.get_encoding`
would download them, and the only public offline route is to pre-fill tiktoken's cache directory
under names derived from the download URLs; instead this uses the loader and the pattern tiktoken's
own GPT-2 plugin uses (data/tokenizer.py goes through here)."""

from __future__ import annotations

from pathlib import Path

from nlq_scale.compat import Private

DISTRIBUTION = "tiktoken"
WRITTEN_FOR = ">=0.7,<1"  # read against 0.14.0

RELIES_ON = (
    Private("tiktoken.load", "data_gym_to_mergeable_bpe_ranks",
            params=("vocab_bpe_file", "encoder_json_file", "vocab_bpe_hash", "encoder_json_hash")),
    Private("tiktoken_ext.openai_public", "r50k_pat_str"),
)  # fmt: skip


def gpt2_mergeable_ranks(vocab_bpe: Path, encoder_json: Path, vocab_bpe_sha256: str, encoder_json_sha256: str) -> dict:
    """GPT-2's BPE ranks from its `vocab.bpe`/`encoder.json` (checked against the given hashes)."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    return data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=vocab_bpe_sha256,
        encoder_json_hash=encoder_json_sha256,
    )


def gpt2_pattern() -> str:
    """The pre-tokenisation regex of GPT-2 (r50k)."""
    from tiktoken_ext.openai_public import r50k_pat_str

    return r50k_pat_str
