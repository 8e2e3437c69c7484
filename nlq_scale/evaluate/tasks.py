"""The local lm-eval tasks (`nlq_lastword`, `nlq_cloze`): task YAMLs shipped in configs/eval/, their
documents built at eval time from the bundled sample text (Python's pydoc topics, the first set of
`nlq_scale.data.sample`), so nothing is downloaded. The documents are a function of the Python
version only (the topics ship with it), built in sorted order; `task_digest` names the exact set.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from importlib import resources
from pathlib import Path

import yaml

LOCAL_TASKS = ("nlq_lastword", "nlq_cloze")
# lm-eval's own tasks the docs describe for a cluster with a dataset cache; any other lm-eval task
# name passes through too.
REAL_TASKS = ("lambada_openai", "hellaswag", "arc_easy", "piqa")
MIN_WORDS, MAX_WORDS = 20, 80  # a passage long enough to predict from, short enough for a tiny context
TASK_SIZE = 100  # documents per local task: a stderr near 0.05 at accuracy 0.5, seconds on CPU
CHOICES = 4
CLOZE_TAIL_WORDS = 8  # words in each cloze continuation


def _prose_paragraphs(topic: str) -> list[str]:
    """A topic's paragraphs of running text: grammar rules, code and tables are indented in the
    topics' reST rendering, headings are underlined; both are left out."""
    out = []
    for block in re.split(r"\n\s*\n", topic):
        lines = block.split("\n")
        if any(line.startswith(" ") for line in lines) or re.fullmatch(r"[*=\-~^]+", lines[-1].strip()):
            continue
        out.append(" ".join(" ".join(lines).split()))
    return out


def passages() -> list[str]:
    """Prose passages of MIN_WORDS..MAX_WORDS words ending a sentence, in topic-name order."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        for text in _prose_paragraphs(topics[name]):
            words = text.split(" ")
            if MIN_WORDS <= len(words) <= MAX_WORDS and text.endswith("."):
                found.append(text)
    return found


def lastword_docs(texts: list[str]) -> list[dict]:
    """{"text"}: a passage without its final full stop, whose last word is a plain word of 3+ letters
    (a word the model can be asked for, not a symbol or a number)."""
    docs = []
    for text in texts:
        text = text[:-1]
        if re.fullmatch(r"[A-Za-z]{3,}", text.split(" ")[-1]):
            docs.append({"text": text})
    return docs[:TASK_SIZE]


def cloze_docs(texts: list[str]) -> list[dict]:
    """{"context", "choices", "label"}: the passage's last CLOZE_TAIL_WORDS words among the tails of
    passages spread over the corpus (a fixed stride, so other topics), at position i % CHOICES."""
    tails = [" ".join(t.split(" ")[-CLOZE_TAIL_WORDS:]) for t in texts]
    stride = max(1, len(texts) // CHOICES)
    docs = []
    for i, text in enumerate(texts[:TASK_SIZE]):
        distractors = [tails[(i + k * stride) % len(texts)] for k in range(1, CHOICES)]
        if tails[i] in distractors:
            continue  # a repeated sentence would be two right answers
        label = i % CHOICES
        choices = distractors[:label] + [tails[i]] + distractors[label:]
        docs.append({"context": " ".join(text.split(" ")[:-CLOZE_TAIL_WORDS]), "choices": choices, "label": label})
    return docs


def task_documents() -> dict[str, list[dict]]:
    texts = passages()
    return {"nlq_lastword": lastword_docs(texts), "nlq_cloze": cloze_docs(texts)}


def _jsonl(docs: list[dict]) -> str:
    return "".join(json.dumps(d, sort_keys=True, ensure_ascii=False) + "\n" for d in docs)


def task_digest(docs: list[dict]) -> str:
    return hashlib.sha256(_jsonl(docs).encode()).hexdigest()[:16]


def shipped_yaml(task: str) -> dict:
    return yaml.safe_load(resources.files("nlq_scale.configs").joinpath(f"eval/{task}.yaml").read_text())


def stage_local_tasks(out: Path) -> dict[str, dict]:
    """Writes each local task's documents and its YAML (data_files made absolute) into `out`, an
    lm-eval include_path; returns task -> {"documents", "digest", "source"}."""
    out.mkdir(parents=True, exist_ok=True)
    info = {}
    for task, docs in task_documents().items():
        data = out / f"{task}.jsonl"
        data.write_text(_jsonl(docs))
        config = shipped_yaml(task)
        config["dataset_kwargs"]["data_files"]["test"] = str(data.resolve())
        (out / f"{task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        info[task] = {"documents": len(docs), "digest": task_digest(docs), "source": f"pydoc topics, Python {platform.python_version()}"}
    return info
