# The two commands a new user needs; each sets up what it needs first.
PY := .venv/bin/python
export PYTHONPATH := $(CURDIR)

.PHONY: setup online test test-fast

setup:
	bash scripts/setup.sh

online: setup  ## the main job: serve a shifting stream and distil the draft online
	$(PY) -m experiments.online --output_dir=outputs/online $(ARGS)

test: setup  ## the whole CPU suite, real-model tests included
	JAX_PLATFORMS=cpu $(PY) -m pytest -q tests $(ARGS)

test-fast: setup  ## skip the tests that load the real model
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -m "not real_model" tests $(ARGS)
