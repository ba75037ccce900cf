# The README's two set-up commands are `make demo` and `make test`; both work from a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU wheel on these machines; a bare `torch` would pull a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
PYTEST  := $(BIN)/python -m pytest
DEMO    := demo-out

.PHONY: install test test-all demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,demo]"
	touch $(STAMP)

# Heavy cases (marker `slow`) and GPU cases are left to `make test-all`; GPU tests skip without CUDA.
test: install
	$(PYTEST) -q -n 2 -m "not slow" tests

test-all: install
	$(PYTEST) -q -n 2 tests

lint: install
	$(BIN)/ruff check qtool tests benchmarks

demo: install
	bash scripts/demo.sh $(BIN) $(DEMO)

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .hypothesis
