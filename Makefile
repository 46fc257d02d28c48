# The few commands a contributor needs. Everything installs into .venv on first use: `make demo` only what the
# demo runs (torch and this package), `make test` and `make lint` also the dev extras (the parity libraries,
# trackers and cluster plugins the tests compare against), `make rehearsal` transformers for its export.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch from PyPI by default: on Linux its CUDA build (with its CUDA libraries), which also runs on a CPU. On a
# machine without a GPU, PyTorch's CPU build is a fraction of the size: TORCH_INDEX=https://download.pytorch.org/whl/cpu.
# On a GPU machine, another CUDA build: TORCH_INDEX=https://download.pytorch.org/whl/cu126, or your own: TORCH=torch
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install demo rehearsal test test-all lint format

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(VENV)/.hf: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[hf]"
	touch $@

install: $(VENV)/.installed

# The main job on the embedded corpus: no network, no extra data needed. Three minutes of pretraining on one
# CPU thread with the recipe of conf/sweep/demo.yaml (bert-tiny with the ALiBi distance bias, batch 16), which
# ends with a model that uses context; results/demo/ has the runs that chose it.
demo: install
	$(PY) pretrain.py +sweep=demo

# The real run (`python pretrain.py budget=24`) rehearsed on a CPU in five to ten minutes: data=wikibooks through
# its hub loaders from local folders in the hub's layout, tokenizer training, crammed-bert under the recipe's
# schedule and batch ramp, SIGTERM and resume, glue-sane, export; only budget, data size and batch sizes scaled
# (docs/pretraining.md). OUT=<folder> puts it elsewhere than outputs/rehearsal.
OUT ?= outputs/rehearsal
rehearsal: $(VENV)/.hf
	$(PY) scripts/rehearsal.py --out $(OUT)

# What a newcomer needs to trust the install and the code: every test but the `slow` ones (end-to-end runs,
# several processes, the rehearsal, the long kernel and optimizer sweeps). test-all runs those too (CI does).
test: $(VENV)/.dev
	$(PY) -m pytest -q -m "not slow"

test-all: $(VENV)/.dev
	$(PY) -m pytest -q

lint: $(VENV)/.dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(VENV)/.dev
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
