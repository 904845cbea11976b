# Fresh machine: `make bench` or `make test`. Both create .venv and install into it.
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PYTHON := $(VENV)/bin/python

.PHONY: venv install install-dist bench test clean

$(VENV)/bin/activate:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(VENV)/bin/activate

install: venv
	$(PIP) install -q -e ".[cpu,bench,notebook,test]"

bench: install
	$(PYTHON) benchmarks/ssd_synthetic.py --amp

# Horovod is compiled against the MXNet installed above (gloo, no MPI). Built once; the wheel
# is cached per Python version under $(WHEELS) and reused on the next fresh clone.
HOROVOD_VERSION := 0.28.1
WHEELS ?= $(HOME)/.cache/gluon-amp-wheels
HOROVOD_ENV := HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
	HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1

install-dist: install
	@if ! $(PYTHON) -c "import horovod.mxnet" 2>/dev/null; then \
	  dir="$(WHEELS)/$$($(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"; \
	  if ! ls "$$dir"/horovod-$(HOROVOD_VERSION)-*.whl >/dev/null 2>&1; then \
	    echo "building horovod $(HOROVOD_VERSION) against MXNet (a few minutes, once)"; \
	    command -v cmake >/dev/null || $(PIP) install -q "cmake>=3.13,<4" || exit 1; \
	    $(PIP) install -q wheel && \
	    PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(HOROVOD_ENV) $(PIP) wheel -q --no-build-isolation \
	      --no-deps horovod==$(HOROVOD_VERSION) -w "$$dir" || exit 1; \
	  fi; \
	  $(PIP) install -q "$$dir"/horovod-$(HOROVOD_VERSION)-*.whl || exit 1; \
	fi
	$(PIP) install -q -e ".[dist]"

test: install-dist
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
