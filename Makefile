# The few commands a contributor needs. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default; on a GPU machine install your CUDA build of torch first, e.g. TORCH=torch
TORCH ?= torch==2.13.0

.PHONY: install demo test lint format

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The main job on the embedded corpus: no network, no extra data needed. Three minutes of budget on CPU, with
# a CPU-sized batch (the recipe's 8192 sequences per update would leave time for a handful of updates), one
# torch thread and no loader workers (on a shared CPU, contending for every core is several times slower).
demo: install
	$(PY) pretrain.py data=embedded arch=tiny budget=0.05 name=demo impl.microbatch_size=32 train.batch_size=128 \
		impl.num_workers=0 impl.cpu_threads=1 train.log_every=25

test: install
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
