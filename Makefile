# The two commands a new user needs; each sets up what it needs first.
PY := .venv/bin/python
export PYTHONPATH := $(CURDIR)
# Test processes (pytest-xdist), each test file in one of them. Two fit a
# 2-core, 24 GiB host: XLA compiles on one core, so two processes overlap
# one's compiling with the other's running. TESTS narrows what runs.
TEST_WORKERS ?= 2
TESTS ?= tests
PYTEST := JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup online test test-fast

setup:
	bash scripts/setup.sh

online: setup  ## the main job: serve a shifting stream and distil the draft online
	$(PY) -m experiments.online --output_dir=outputs/online $(ARGS)

test: setup  ## the whole CPU suite, real-model tests included
	$(PYTEST) $(TESTS) $(ARGS)

test-fast: setup  ## skip the tests that load the real model
	$(PYTEST) -m "not real_model" $(TESTS) $(ARGS)
