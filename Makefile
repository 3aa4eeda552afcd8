# The README's two commands. Both create .venv when missing and install the project into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: run test test-slow lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	touch $@ $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(BIN)/dsv41 report

test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow"

# pytest exits 5 when no test carries the mark; that is not a failure.
test-slow: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -m slow || [ $$? -eq 5 ]

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
