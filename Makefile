# The README's two commands: `make quickstart` and `make test`. Both create .venv first if missing.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test workers (pytest-xdist): most of a test's time is spent in subprocesses and SLURM waits, so two
# workers finish the suite sooner even on 2 cores; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: setup tcmalloc test test-fast test-portability quickstart bench chaos clean-venv

setup: $(STAMP)

# The interpreter the venv is made with: Python 3.12 (megatron-core 0.19 ships cp312 wheels only).
# PYTHON=... picks another; otherwise python3.12 on PATH, else pyenv's newest 3.12.
PYTHON ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c '' 2>/dev/null && echo python3.12 \
  || ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1)

# pyproject.toml states ranges (so the package installs beside a cluster's own torch); constraints.txt
# pins the exact versions CI and this machine run, for reproducible installs.
$(STAMP): pyproject.toml constraints.txt
	@[ -n "$(PYTHON)" ] || { echo "make setup: Python 3.12 not found (install it, e.g. pyenv install 3.12, or set PYTHON=/path/to/python3.12)" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -c constraints.txt -e '.[dev]'
	@$(MAKE) --no-print-directory tcmalloc
	touch $(STAMP)

# tcmalloc for the CPU rank processes (runtime.cpu_allocator: auto); as root on Debian/Ubuntu it is
# installed, elsewhere the ranks keep glibc's malloc (slower on CPU, same results).
APT_TCMALLOC := apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4
tcmalloc:
	@/sbin/ldconfig -p | grep -q libtcmalloc_minimal.so.4 \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && { $(APT_TCMALLOC) >/dev/null 2>&1 || { apt-get update -qq && $(APT_TCMALLOC) >/dev/null; }; }; } \
	  || echo "tcmalloc not installed (apt-get install libtcmalloc-minimal4): CPU ranks use glibc's malloc"

# Everything, including the slow multi-process and SLURM tests (what CI runs).
test: setup
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Local inner loop: skip multi-process and SLURM tests.
test-fast: setup
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

# The suite under the other numeric environments a machine of this kind may give it: torch's
# non-vectorised CPU kernels, glibc's malloc instead of tcmalloc (a user's LD_PRELOAD wins over
# runtime.cpu_allocator: auto), and one OpenMP thread (the fast tests; ranks set their own). Each is
# a whole suite run, so CI does not run them: `make -k test-portability` runs all three,
# `make portability-glibc` one.
PORTABILITY := default-kernels glibc one-thread
ENV_default-kernels := ATEN_CPU_CAPABILITY=default
ENV_glibc := LD_PRELOAD=libc.so.6
ENV_one-thread := OMP_NUM_THREADS=1
SUITE_default-kernels := -n $(TEST_WORKERS) --dist loadfile
SUITE_glibc := -n $(TEST_WORKERS) --dist loadfile
SUITE_one-thread := -m "not slow"
test-portability: $(addprefix portability-,$(PORTABILITY))
portability-%: setup
	@env $(ENV_$*) $(BIN)/python -c "import torch; from nlq_scale.runtime.allocator import loaded_allocator as a; \
	  print('== portability-$*: $(ENV_$*): kernels', torch.backends.cpu.get_cpu_capability(), '| allocator', a(), \
	        '| threads', torch.get_num_threads())"
	env $(ENV_$*) $(BIN)/pytest -q $(SUITE_$*) $(PYTEST_ARGS)

quickstart: setup
	$(BIN)/nlq-scale quickstart

# Every benchmark but chaos.py, which runs its own SLURM cluster for about 15 minutes (as root): `make chaos`.
bench: setup
	for b in $(filter-out benchmarks/chaos.py,$(wildcard benchmarks/*.py)); do $(BIN)/python $$b; done

chaos: setup
	$(BIN)/python benchmarks/chaos.py --seeds 1 2

clean-venv:
	rm -rf $(VENV)
