import inspect

import numpy as np
import pytest

from nlq_scale.data.tokenizer import GPT2_FILE_SHA256, gpt2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


def test_gpt2_ids(tok):
    enc = tok.encoding
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert tok.eot == 50256
    assert enc.n_vocab == 50257
    assert enc.decode([15496, 995]) == "Hello world"


def test_files_hash_to_tiktoken_expectations(tok):
    from tiktoken_ext import openai_public

    source = inspect.getsource(openai_public.gpt2)
    for name, sha in GPT2_FILE_SHA256.items():
        assert sha in source, name
        assert tok.files[name] == sha
    assert tok.describe()["files_sha256"] == GPT2_FILE_SHA256


def test_documents_end_with_eot_and_cannot_inject_it(tok):
    docs = tok.encode_documents(["Hello world", "a <|endoftext|> b"])
    assert docs[0].dtype == np.uint16
    assert docs[0].tolist() == [15496, 995, 50256]
    assert docs[1].tolist().count(50256) == 1 and docs[1][-1] == 50256


def test_no_tiktoken_cache_copies(tmp_path, monkeypatch):
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):  # where tiktoken would cache instead of TMPDIR
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    gpt2_tokenizer()
    assert not (tmp_path / "data-gym-cache").exists()


def test_documents_are_ordinary_encodings(tok):
    from tests.test_data_helpers import documents

    docs = documents(50)
    for text, ids in zip(docs, tok.encode_documents(docs)):
        assert ids[:-1].tolist() == tok.encoding.encode_ordinary(text)
