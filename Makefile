# Set-up is part of every target: a fresh clone needs only Python >= 3.11.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test clean

venv: $(VENV)/.installed

# torch first: an existing (CUDA) torch in the base interpreter is used as is; otherwise the
# pinned CPU build, so nothing pulls a multi-GB CUDA wheel onto a CPU machine.
$(VENV)/.installed: pyproject.toml
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    $(PY) -m venv --system-site-packages $(VENV); \
	else \
	    $(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

demo: venv
	$(BIN)/teratron train

test: venv
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs
