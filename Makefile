# Fresh machine: `make bench` or `make test`. Both create .venv and install into it.
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PYTHON := $(VENV)/bin/python

.PHONY: venv install bench test clean

$(VENV)/bin/activate:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(VENV)/bin/activate

install: venv
	$(PIP) install -q -e ".[cpu,bench,notebook,test]"

bench: install
	$(PYTHON) benchmarks/ssd_synthetic.py --amp

test: install
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
