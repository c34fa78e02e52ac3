# mmrl developer commands. `make run` and `make test` work on a fresh machine:
# they create .venv, install mmrl with the pinned versions in constraints.txt, then run.
VENV ?= .venv
# Everything the test suite exercises; `make install EXTRAS=dev` for a lighter install.
EXTRAS ?= dev,serve,rewards,diffusion,distributed,trackers,hub,docs
# Test processes (pytest-xdist): the CI machine has 2 cores; each worker runs torch on its share.
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
# Keep the checkout's folders (datasets/, verifiers/) off sys.path: only `mmrl.*` is importable.
export PYTHONSAFEPATH := 1
# Never reach a model hub: a stray download fails loudly instead of hanging.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# mkdocs 1.x prints a banner about its successor on every build.
export NO_MKDOCS_2_WARNING := 1
# DeepSpeed installs without building its C++ ops; they are built on first use, into one folder
# per virtual environment that tests/conftest.py names (mmrl.distributed.torch_extensions_dir).
export DS_BUILD_OPS := 0

.PHONY: install run test test-fast docs wheel-check lint format bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

## Train GRPO on the built-in task with the built-in tiny base (one-time warm-up included).
run: install
	$(VENV)/bin/mmrl train --task vision_reasoning

## Lint, format check, the docs build, and the whole test suite (slow tests included; the
## slowest tests listed at the end).
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=40

## The inner loop: unit and integration tests that run no training loop (a few minutes).
test-fast: install
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow and not trains" --durations=10

## The docs site (site/), its config reference regenerated from the code first.
docs: install
	$(PY) -m mmrl.config_reference > docs/reference/config.md
	$(VENV)/bin/mkdocs build --strict

## Build the wheel, install it with its dependencies into a fresh venv outside the checkout, run the CLI.
wheel-check:
	PYTHON=python3 bash .ci/wheel_check

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## Rollout + training throughput on the default task.
bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache
