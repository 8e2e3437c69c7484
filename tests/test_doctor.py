"""`nlq-scale doctor`: the node report, and the short train/kill/resume check every arm gets on a new
node (here on the CPU, fp32; on a GPU node the same command runs bf16)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import nlq


def test_node_report_names_what_a_gpu_run_needs():
    r = nlq("doctor", "--json")
    assert r.returncode == 0, r.stderr
    node = json.loads(r.stdout)["node"]
    assert {"torch", "cuda", "driver", "nccl", "bf16", "kernels"} <= node.keys()
    assert node["cuda_available"] is False and "0 CUDA device(s)" in node["cuda"]


def test_doctor_asking_for_cuda_here_is_one_line():
    r = nlq("doctor", "--train", "--device", "cuda")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "CUDA" in r.stderr


@pytest.mark.slow
def test_doctor_trains_kills_and_resumes_bit_exactly(tmp_path):
    r = nlq("doctor", "--train", "--arms", "nonlinear", "--steps", "4", "--device", "cpu", "--json",
            "--work-dir", str(tmp_path), timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    trials = json.loads(r.stdout.strip().splitlines()[-1])["trials"]
    assert set(trials) == {"megatron-nonlinear", "deepspeed-zero1-nonlinear"}
    for t in trials.values():
        assert t["resume_bit_exact"] is True and t["tokens_per_s"] > 0, t
    # each result is on stderr as its trial ends, before the report
    for name in trials:
        assert f"[nlq-scale doctor] {name}: resume bit-exact True, " in r.stderr
