# lucid_replay developer commands. Needs only python3 (with venv) and make.
#
#   make demo   create .venv if needed, then run the demo script ($(DEMO))
#   make test   create .venv if needed, then lint, format check, mypy, pytest, docs build
#   make docs   serve the documentation locally
#   make bench  create .venv-bench (torch $(TORCH_BENCH)) and run the benchmarks
#
# Every variable below can be overridden from the command line or the environment, e.g.
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

VENV        ?= .venv
PYTHON      ?= python3
TORCH       ?= torch==2.13.0
DEMO        ?= examples/r2d2_cartpole.py
VENV_BENCH  ?= .venv-bench
TORCH_BENCH ?= torch==2.14.1
# `make bench` measures two passes, each in a fresh stock process (glibc's malloc untouched):
# one torch thread, and torch's default count; every bar must hold in both. It then rewrites
# the generated part of $(BENCH_PAGE) (`BENCH_PAGE=` leaves the page alone). Extra runner
# options go in BENCH_ARGS: `make bench BENCH_ARGS=--quick` (never written to the page),
# `BENCH_ARGS=--tuned-malloc` (tuned-allocator passes reported beside), `--device cuda`.
BENCH_ARGS  ?=
BENCH_PAGE  ?= docs/benchmarks.md
SITE_DIR    ?= site
# Two xdist workers: the suite is CPU-bound Python (Hypothesis, chi-square checks, small tensors),
# so two workers on the 2-core reference machine nearly halve it, for a fixed ~6 s of worker
# start-up (each imports torch and collects). That pays off once the serial run exceeds ~15 s.
# `make test PYTEST_ARGS=` runs serially (e.g. to debug); pytest alone, without -n, is serial too.
PYTEST_ARGS ?= -n 2

BIN         := $(VENV)/bin
STAMP       := $(VENV)/.lucid-replay-installed
BENCH_BIN   := $(VENV_BENCH)/bin
BENCH_STAMP := $(VENV_BENCH)/.lucid-replay-installed
COMMA       := ,

.PHONY: setup demo test lint typecheck unit docs-build docs bench clean

# $(call install,VENV,TORCH,EXTRAS): create VENV if needed, install TORCH FIRST, then the project
# with EXTRAS while torch stays pinned by a constraint file: a bare `torch` requirement would
# otherwise let pip fetch (or swap in) a multi-GB CUDA build. The stamp lives inside the venv,
# so deleting the venv also forces a reinstall; editing pyproject.toml re-runs the install.
define install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --upgrade pip
	$(1)/bin/python -m pip install $(2)
	$(1)/bin/python -m pip freeze | grep -i '^torch==' > $(1)/torch-constraint.txt
	$(1)/bin/python -m pip install -c $(1)/torch-constraint.txt -e ".[$(3)]"
	touch $@
endef

$(STAMP): pyproject.toml
	$(call install,$(VENV),$(TORCH),dev$(COMMA)test$(COMMA)examples$(COMMA)fast)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python $(DEMO)

test: lint typecheck unit docs-build

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

# NO_MKDOCS_2_WARNING silences Material 9.8's end-of-life banner (printed, not a build warning).
docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(SITE_DIR)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# Benchmarks run against TorchRL's prioritized samplers, whose C++ extension only loads with the
# torch it was built against (2.14.1), hence a separate venv. Note: torch 2.14.1 from PyPI is the
# CUDA build (~0.5 GB wheel plus several GB of nvidia-* wheels).
$(BENCH_STAMP): pyproject.toml
	$(call install,$(VENV_BENCH),$(TORCH_BENCH),bench)

bench: $(BENCH_STAMP)
	$(BENCH_BIN)/python -m benchmarks.run --threads 1,default \
		$(if $(BENCH_PAGE),--page $(BENCH_PAGE)) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_BENCH) $(SITE_DIR) build dist *.egg-info \
		.pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./.git -prune -o -name __pycache__ -type d -exec rm -rf {} +
