"""The public API (docs/api.md): its example runs in a fresh process, and `import nlq_scale` is cheap."""

import re
import subprocess
import sys

from tests.conftest import REPO


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_docs_example_runs():
    (example,) = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "api.md").read_text(), re.S)
    r = run_python(example)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "(2, 64, 50304)"


def test_import_is_cheap_and_api_loads_lazily():
    r = run_python(
        "import sys, nlq_scale\n"
        "assert 'torch' not in sys.modules and 'nlq_scale.api' not in sys.modules\n"
        "cfg = nlq_scale.load_config('124m', 'linear')\n"
        "print(nlq_scale.count_parameters(cfg).non_embedding, 'torch' in sys.modules)"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["84973056", "False"]
