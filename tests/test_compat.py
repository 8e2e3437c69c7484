"""Every private upstream API the project touches is listed in its library's compat module; these
fail, naming the API, when the installed library no longer provides it or left the version range
the module was written for."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nlq_scale.compat import MODULES, Private, version_problem

REPO = Path(__file__).resolve().parents[1]
COMPAT = [importlib.import_module(name) for name in MODULES]
RELIED_ON = [(m.DISTRIBUTION, p) for m in COMPAT for p in m.RELIES_ON]


@pytest.mark.parametrize("module", COMPAT, ids=lambda m: m.DISTRIBUTION)
def test_installed_version_is_the_one_the_compat_module_was_written_for(module):
    assert version_problem(module.DISTRIBUTION, module.WRITTEN_FOR) is None


@pytest.mark.parametrize("private", [p for _, p in RELIED_ON], ids=[f"{d}:{p}" for d, p in RELIED_ON])
def test_upstream_still_provides(private: Private):
    assert private.problem() is None


@pytest.mark.parametrize(
    "private, message",
    [
        (Private("megatron.core.tensor_parallel.random", "_no_such_function"), "gone"),
        (Private("nlq_scale.no_such_module", "x"), "gone"),
        (Private("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", params=("state",)), "parameters are now"),
        (Private("streaming.base.dataset:StreamingDataset.__init__", "self._no_such_attr", in_source=True), "no longer uses"),
    ],
)
def test_a_changed_upstream_is_reported_by_name(private, message):
    assert message in private.problem()


def test_a_version_outside_the_range_is_reported():
    assert "outside <0.1" in version_problem("submitit", "<0.1")


# Private upstream names outside nlq_scale/compat would escape the checks above.
_PRIVATE_USE = re.compile(
    r"from (megatron|streaming|deepspeed|submitit|torch)\S* import _|\btiktoken(\.load|_ext)\b|"
    r"\b(streaming\.base|submitit\.core|submitit\.local|deepspeed\.runtime|deepspeed\.comm|torch\.utils\.weak)\b|"
    r"\b(mp_random|moe_utils|distrib_optimizer|env|dataset)\._[a-z]|"
    r"[\"'](_shutdown_workers|_shm_prefix_int|_iterator|_executor|_resume_shm|_usr_sig)[\"']"
)


def lines_outside_compat(pattern: re.Pattern) -> list[str]:
    """Where the package's code outside nlq_scale/compat matches `pattern` (comments skipped)."""
    return [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "nlq_scale").rglob("*.py"))
        if "compat" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]


def test_no_private_upstream_use_outside_compat():
    offenders = lines_outside_compat(_PRIVATE_USE)
    assert not offenders, "\n".join(offenders)


def test_grad_norm_fallback_on_the_device_matches_megatrons():
    """compat.megatron_shim.device_grad_norm_fallback: the norm megatron's clipping computes without Apex
    or TE, found without a host round trip per tensor, equal to megatron's own fallback."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from nlq_scale.compat import megatron_shim

    torch.manual_seed(0)
    grads = [torch.randn(n) * s for n, s in ((7, 1.0), (300, 1e-3), (64, 20.0), (1, 0.5))]
    megatron_shim.device_grad_norm_fallback()
    assert clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm
    ours, _ = clip_grads.l2_norm_impl(2048 * 32, None, [grads], False)
    theirs = torch.norm(torch.tensor([torch.norm(g) for g in grads]))  # the fallback's math, on the host
    assert ours.shape == (1,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours[0], theirs, rtol=1e-6, atol=0)


def test_streaming_is_imported_without_its_text_vision_and_multimodal_datasets():
    """The project imports streaming through compat.streaming only, which skips the datasets the
    package's __init__ imports (scikit-learn and torchvision behind them, seconds of a rank's start)
    and the data loader streaming.base's __init__ imports (transformers behind it); what those
    __init__s export still imports from `streaming` and `streaming.base`, on first use."""
    direct = lines_outside_compat(re.compile(r"^\s*(import|from) streaming\b"))
    assert not direct, "\n".join(direct)
    code = ("import sys; from nlq_scale.compat.streaming import MDSWriter; import streaming; "
            "assert streaming.MDSWriter is MDSWriter and streaming.__version__; "
            "print([m for m in ('sklearn', 'torchvision', 'transformers', 'streaming.text', 'streaming.vision') "
            "if m in sys.modules]); from streaming.base import StreamingDataLoader; "
            "print(StreamingDataLoader is streaming.StreamingDataLoader, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True True"], out.stdout


def test_megatron_imports_without_dynamo_and_its_fused_functions_still_compile():
    """compat.megatron_jit: after `import nlq_scale`, importing megatron's GPT leaves dynamo and
    inductor out, and a fused function compiles on its first call, with eager's result."""
    code = """
import sys, torch
import nlq_scale
from megatron.core import jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
import megatron.core.models.gpt
from nlq_scale.compat.megatron_jit import deferred_compile
print(jit.jit_fuser is deferred_compile, 'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules)
x, b = torch.randn(4, 8), torch.randn(8)
out = bias_gelu(b, x)
print('torch._dynamo' in sys.modules, torch.allclose(out, bias_gelu.__wrapped__(b, x), rtol=1e-6, atol=1e-6))
"""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "False", "True", "True"]
