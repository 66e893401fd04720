# The two entry points a new user needs: `make demo` and `make test`.
# Both create .venv when missing, install the pinned torch FIRST (so that the
# project's `torch>=2.4` is already satisfied and no CUDA build is downloaded),
# then install the project itself.

PYTHON ?= python3
TORCH  ?= torch==2.13.0
VENV   ?= .venv
BIN     = $(VENV)/bin
# The stamp's name carries the torch requirement, so `make test TORCH=...` reinstalls.
STAMP   = $(VENV)/.installed-$(shell printf '%s' '$(TORCH)' | cksum | cut -d' ' -f1)

.PHONY: machinery gpu-check gpu-wheels demo test quick lint shellcheck typecheck pytest soak bench clean slurm nodes metrics docs docs-check

# Debian packages: tests/slurm/ runs a real single-node Slurm (slurm-wlm and munge),
# tests/multinode/ makes nodes from network namespaces (iproute2, util-linux) with an
# etcd member on each (etcd-server, etcd-client), and `make lint` runs shellcheck. Their install steps run on EVERY `make test` (a no-op when
# the packages are there), so that a broken install fails on any machine, not only a new
# one. Where they cannot be installed (no root or apt-get) the tests and checks that need
# them are skipped with the reason; in CI (CI=true) that is a failure.
SLURM_SCRIPT = scripts/slurm-localhost.sh
NODES_SCRIPT = scripts/nodes-localhost.sh
DEBIAN       = scripts/debian-packages.sh
SHELL_SCRIPTS = $(wildcard scripts/*.sh) .ci/run
IS_CI := $(filter 1 true yes,$(shell printf '%s' '$(CI)' | tr A-Z a-z))
# $(call optional,WHAT): after a failed install, fail in CI, else warn and go on
optional = { if [ -n "$(IS_CI)" ]; then echo "CI: $(1) must be installed here" >&2; exit 1; fi; \
             echo "warning: $(1) not installed: what needs it is skipped" >&2; }

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/steadfast demo

# tests/dist is named on its own: ruff leaves folders called "dist" out by default
lint: $(STAMP) shellcheck
	$(BIN)/ruff check src tests tests/dist examples bench scripts docs/conf.py docs/_ext
	$(BIN)/ruff format --check src tests tests/dist examples bench scripts docs/conf.py docs/_ext

shellcheck:
	@bash $(DEBIAN) ensure shellcheck || $(call optional,shellcheck)
	@for f in $(SHELL_SCRIPTS); do bash -n "$$f" || exit 1; done
	@if command -v shellcheck >/dev/null; then shellcheck $(SHELL_SCRIPTS) && \
	  echo "shellcheck: $(words $(SHELL_SCRIPTS)) scripts clean"; fi

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

# The documentation site (Sphinx + MyST, docs/conf.py): `make docs` builds it into
# docs/_build/html; `make test` builds it with every warning an error (a broken page
# link, anchor or {ref}, a docstring autodoc cannot read) and checks no external link
# (this machine is offline; none is fetched).
DOCS_OUT ?= docs/_build/html
docs: $(STAMP)
	$(BIN)/sphinx-build -q -b html docs $(DOCS_OUT)
	@echo "docs: open $(DOCS_OUT)/index.html"

docs-check: $(STAMP)
	$(BIN)/sphinx-build -q -W --keep-going -E -b html docs $(DOCS_OUT)
	@echo "docs: built with warnings as errors"

slurm:
	@bash $(SLURM_SCRIPT) install || $(call optional,Slurm (tests/slurm))

nodes:
	@bash $(NODES_SCRIPT) install || $(call optional,iproute2 util-linux etcd (tests/multinode))

# a real Prometheus scrapes a run (tests/e2e/test_metrics_prometheus.py) and promtool
# checks the metrics (installed without its recommends, its service never started);
# tmux is the terminal `steadfast watch` is tested in (tests/e2e/test_watch.py)
metrics:
	@bash $(DEBIAN) ensure prometheus tmux || $(call optional,prometheus tmux (the metrics tests))

# Three pytest-xdist workers (PYTEST_WORKERS=0: one process): tests/slurm, which mostly
# waits on Slurm's timers, has one to itself and the CPU-bound rest has two
# (tests/conftest.py). Fresh clones' .ci/run here, idle: 26:39 (pytest 24:57) since
# forked workers no longer walk the template's objects (30:08 with half that cut;
# 28:51 and 33:32 before it); with two workers, Slurm's sharing one: 31:12. Three
# workers that each take anything made every test 29 % slower and failed timing-tight
# tests.
# A failed run keeps its failures' names (test-results/failed.txt, written as each fails)
# and its whole log (test-results/pytest.log): scripts/pytest-kept.sh.
PYTEST_WORKERS ?= 3
PYTEST_ARGS ?=
RESULTS ?= test-results
pytest: $(STAMP) slurm nodes metrics
	bash scripts/pytest-kept.sh $(BIN)/python $(RESULTS) -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# mypy and Sphinx (a core each) run beside the Debian installs (one after the other:
# they share dpkg's lock and the policy that keeps their daemons off), which on a new
# machine take minutes; then the lint, then the tests
test: $(STAMP)
	$(MAKE) --no-print-directory -j3 machinery typecheck docs-check
	$(MAKE) --no-print-directory lint pytest

machinery:
	@$(MAKE) --no-print-directory slurm
	@$(MAKE) --no-print-directory nodes
	@$(MAKE) --no-print-directory metrics
	@bash $(DEBIAN) ensure shellcheck || $(call optional,shellcheck)

# The quick tier, for working between edits (at most 5 minutes; CI runs every test):
# tests/quick.txt, the tests that cover the most of src/steadfast per second, chosen by
# `scripts/quick_tier.py measure` then `pick` (coverage.py in every process of a run).
quick: $(STAMP) slurm nodes metrics
	$(BIN)/python scripts/quick_tier.py run $(PYTEST_ARGS)

# The whole suite while a neighbour keeps every core busy at normal priority and runs a
# steadfast job of its own (scripts/soak.sh): real nodes are never idle. SOAK_TESTS
# narrows it, SOAK_REPEAT=N runs it N times.
SOAK_TESTS ?= tests
soak: $(STAMP) slurm nodes metrics
	bash scripts/soak.sh $(BIN)/python $(SOAK_TESTS) -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# The GPU checks in one command (scripts/gpu-check.sh): on a machine with no NVIDIA GPU one
# line and exit 0; on a GPU machine it sets itself up from this tree (the machine's own
# CUDA torch, never this venv's CPU one), runs for 8 minutes at most, prints a table and
# writes gpu-check.json. Nothing in `make test` depends on it.
gpu-check:
	bash scripts/gpu-check.sh

# For a GPU machine that reaches no package index: the wheels gpu-check may miss there
# (CPython 3.12, x86_64), into .whl/ (ignored by git), which gpu-check installs from.
GPU_WHEELS ?= isal
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build src/*.egg-info docs/_build docs/_generated
