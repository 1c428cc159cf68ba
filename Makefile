# Set-up and entry points. `make demo` and `make test` each create .venv if it is missing, install the project
# into it (editable), then run. Nothing is downloaded at run time: the demo and the tests make their own data.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) tools/prepare_deepspeed.py
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(PY) -m ruff check squad tasks kernels tools tests

bench: $(STAMP)
	$(PY) tools/bench.py

clean-venv:
	rm -rf $(VENV)
