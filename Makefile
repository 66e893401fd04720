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

.PHONY: demo test lint typecheck pytest bench clean slurm

# tests/slurm/ runs a real single-node Slurm: Debian's slurm-wlm and munge, installed
# here when missing and the machine allows it (root and apt-get); elsewhere those tests
# are skipped with the reason (never in CI, where they fail instead).
SLURM_SCRIPT = scripts/slurm-localhost.sh

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/steadfast demo

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench
	$(BIN)/ruff format --check src tests examples bench

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

slurm:
	@bash $(SLURM_SCRIPT) check || { \
	  if bash $(SLURM_SCRIPT) can-install; then \
	    echo "installing Slurm for tests/slurm (slurm-wlm, munge)"; bash $(SLURM_SCRIPT) install; \
	  else echo "no Slurm here and no root+apt-get to install it: tests/slurm will be skipped"; fi; }

pytest: $(STAMP) slurm
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build src/*.egg-info
