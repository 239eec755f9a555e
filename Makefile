# clipmill: `make demo` and `make test` do all set-up on a fresh machine.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The torch build to install when the venv has none. Installed first and alone, so that no
# other package's "torch" requirement can pull a multi-GB CUDA build instead.
TORCH  ?= torch==2.13.0

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/clipmill run examples/ad-batch.csv --out clipmill-out \
		--template "{dish} on a table in {store}, {camera}"

test: install
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) clipmill-out clipmill.db clipmill.db-* .pytest_cache
