# clipmill: `make demo` and `make test` do all set-up on a fresh machine.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The torch build to install when the venv has none. Installed first and alone, so that no
# other package's "torch" requirement can pull a multi-GB CUDA build instead.
TORCH  ?= torch==2.13.0

.PHONY: install demo demo-model test test-fast clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e '.[dev]'
	touch $@

# The shapes-world batch (4 English, 4 Chinese rows) with the built-in shapes model.
demo: install
	$(VENV)/bin/clipmill run examples/shapes-batch.csv --out clipmill-out

# Train the built-in shapes model from SEED and export it into pipeline/weights/shapes/.
# Checkpoints live in $CLIPMILL_TRAIN_DIR (default ~/.cache/clipmill/train): rerun to resume.
# THREADS=1 while anything else runs on the machine (contending threads are 10x slower).
# It trains on CUDA when torch sees a GPU, else on the CPU; DEVICE=cpu or DEVICE=cuda:1 picks one.
SEED    ?= 0
THREADS ?= 1
DEVICE  ?=
demo-model: install
	nice -n 10 $(VENV)/bin/clipmill train-model --seed $(SEED) --threads $(THREADS) $(if $(DEVICE),--device $(DEVICE))

test: install
	$(VENV)/bin/pytest -q

# no servers, browser or worker processes; under 2 minutes on 2 cores
test-fast: install
	$(VENV)/bin/pytest -q --fast

clean:
	rm -rf $(VENV) clipmill-out clipmill.db clipmill.db-* .pytest_cache
