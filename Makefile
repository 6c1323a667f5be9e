# Quick start: `make demo` then `make test`. Everything installs into .venv; torch is the CPU wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SOURCES := $(shell find packages versioning.py -name '*.py' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.toml' 2>/dev/null)

.PHONY: demo test bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python $(SOURCES)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "setuptools>=68" "Cython>=3.0" "numpy>=1.24" "scipy>=1.10" "scikit-learn>=1.3"
	$(PIP) install -q --no-build-isolation packages/popir packages/popsim packages/popdata packages/poptorch
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/train_digits.py

$(VENV)/.nox: $(VENV)/bin/python
	$(PIP) install -q "nox>=2024.3"
	touch $@

test: $(VENV)/.nox
	$(VENV)/bin/nox

bench: $(VENV)/.nox
	$(VENV)/bin/nox -s bench

clean:
	rm -rf $(VENV) .nox build dist packages/*/build packages/*/src/*.egg-info
	find packages -name '*.so' -delete -o -name '*.c' -path '*popsim*' -delete
