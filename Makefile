# Fresh machine: `make bench` or `make test`. Both create .venv and install into it.
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PYTHON := $(VENV)/bin/python

.PHONY: venv install install-dist bench lint test test-quick test-numpy126 test-py312 check-py312 clean

$(VENV)/bin/activate:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(VENV)/bin/activate

# On Python 3.11 this venv keeps numpy 1.23.5, the numpy MXNet 1.9.1 was released with (no shim
# needed); setup.py allows 1.23-1.26 there, and Python 3.12 gets 1.26 (docs/python.md).
install: venv
	$(PIP) install -q -e ".[cpu,bench,notebook,test]" "numpy<1.24; python_version<'3.12'"

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

# Real clients the suite runs (tests/mxnet_layer/clients/). Sockeye pins mxnet and numpy
# versions of its own: --no-deps keeps the venv's (its imports work with them).
# GluonTS 0.11 (the last with gluonts.mx for MXNet 1.9) asks for pandas~=1.0: --no-deps keeps
# the venv's pandas 2 (gluoncv's), which runs it; pydantic 1 and toolz are what it imports besides.
# d2l 1.0.3 pins mxnet/numpy/pandas of its own: --no-deps keeps the venv's; what d2l.mxnet
# imports besides: requests and matplotlib (gluoncv brings them), IPython and matplotlib-inline
# (the notebook extra's ipykernel brings them).
CLIENTS := sockeye==2.3.24 sacrebleu==1.4.14 portalocker \
	gluonts==0.11.12 "pydantic>=1.7,<2" "toolz>=0.10" d2l==1.0.3

# ruff.toml: pyflakes and pycodestyle (E, W, F), lines up to 120 characters.
lint: install
	$(VENV)/bin/ruff check .

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file to each at a time: its
# tests spend most of their time in one core each (MXNet's import in the subprocesses they start,
# single-threaded graph work), so a 2-core host runs it in about half the time. Every test
# already leaves no state behind (tests/README.md); a file's module-scoped fixtures stay in one
# process. Default: the CPUs, at most 4 (each worker holds an MXNet of its own, up to 3 GB).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

test: install-dist lint
	$(PIP) install -q --no-deps $(CLIENTS)
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) tests

# The suite without the tests marked slow (the benchmarks, the notebook, the longest client runs):
# for a local run before a commit. `make test` runs everything.
test-quick: install-dist lint
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) -m "not slow" tests

# numpy 1.26 (what Python 3.12 gets) on this Python, in a venv of its own: the shim's claims, the
# startup hook (`import mxnet` first) in this editable install and in a wheel installed beside it,
# the launcher (GluonCV's R-CNN task under it), the suite's core (init/patching, trainer, convert,
# emulate) and make bench's script. No Horovod there.
NP126_VENV := .venv-np126
NP126_TESTS := $(addprefix tests/mxnet_layer/,compat/test_numpy_shim.py compat/test_numpy_startup.py \
	compat/test_compat.py launch/test_launcher.py patching/test_patching.py training/test_trainer.py \
	convert/test_convert.py execution/test_emulation.py benchmarks/test_benchmarks.py::test_ssd_synthetic_amp_smoke)

$(NP126_VENV)/bin/activate:
	$(PY) -m venv $(NP126_VENV)
	$(NP126_VENV)/bin/pip install -q --upgrade pip

# setuptools>=68 gives distutils the way Python 3.12 gets it (setup.py's marker does not apply on 3.11).
test-numpy126: $(NP126_VENV)/bin/activate
	$(NP126_VENV)/bin/pip install -q -e ".[cpu,bench,test]" "numpy>=1.26,<1.27" "setuptools>=68"
	$(NP126_VENV)/bin/python -m pytest -q $(NP126_TESTS)

# CPython 3.12 itself, where this machine has one (on PATH, or pyenv's; PY312=... names another):
# the numpy-1.26 subset above and the tests that read CPython's bytecode and tracing, in a venv
# of its own (no Horovod, and no Sockeye: its FP32 checkpoints fail on numpy >= 1.24,
# docs/python.md). Where there is none, it says so and check-py312's resolution stands alone.
PY312 ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo $$p; break; }; done)
PY312_VENV := .venv-py312
PY312_TESTS := $(NP126_TESTS) tests/mxnet_layer/patching/test_region_interrupts.py

test-py312:
	@if [ -z "$(PY312)" ]; then echo "test-py312: no CPython 3.12 here (PY312=/path/to/python3.12 names one)"; exit 0; fi
	[ -x $(PY312_VENV)/bin/python ] || { $(PY312) -m venv $(PY312_VENV) && $(PY312_VENV)/bin/pip install -q --upgrade pip; }
	$(PY312_VENV)/bin/pip install -q -e ".[cpu,bench,test]"
	$(PY312_VENV)/bin/python -m pytest -q $(PY312_TESTS)

# Without a CPython 3.12 to run, this shows that the wheel with every extra but dist
# (Horovod has no wheels) resolves to binary wheels for CPython 3.12 on this platform. pip
# evaluates markers for the Python running it, not for --python-version (pypa/pip#11010), so the
# wheel's requirements marked for 3.12 (numpy>=1.26, setuptools) are read from it and added.
# The test extra is read from the wheel too, less gluonnlp: 0.10.0 exists only as an sdist,
# which pip builds on the user's Python and a binary-only resolution cannot include.
SDIST_ONLY := gluonnlp
PY312_CHECK := build/py312-check
define PY312_ONLY_REQS
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
whl = zipfile.ZipFile(sys.argv[1])
meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
py312 = {"python_version": "3.12", "python_full_version": "3.12.0"}
sdist_only = set(sys.argv[2].split())
for line in meta.splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1])
        if req.marker and req.marker.evaluate(py312) and not req.marker.evaluate():
            req.marker = None
            print(req)
        elif req.marker and req.marker.evaluate({**py312, "extra": "test"}) and \
                not req.marker.evaluate({**py312, "extra": ""}) and req.name not in sdist_only:
            req.marker = None
            print(req)
endef
export PY312_ONLY_REQS

check-py312: venv
	rm -rf $(PY312_CHECK) && mkdir -p $(PY312_CHECK)
	$(PIP) wheel -q --no-deps . -w $(PY312_CHECK)
	whl=$$(ls $(PY312_CHECK)/gluon_amp-*.whl) && reqs=$$($(PYTHON) -c "$$PY312_ONLY_REQS" $$whl "$(SDIST_ONLY)") && \
	echo "requirements for Python 3.12 only, and the test extra's but $(SDIST_ONLY): $$reqs" && \
	$(PIP) install --dry-run --ignore-installed --python-version 3.12 --only-binary=:all: \
	  "$$whl[cpu,bench,notebook]" $$reqs
	@echo "Python 3.13 must be refused (python_requires):"
	$(PIP) install -q --dry-run --ignore-installed --python-version 3.13 --only-binary=:all: --no-deps \
	  $(PY312_CHECK)/gluon_amp-*.whl 2>&1 | grep "requires a different Python"

clean:
	rm -rf $(VENV) $(NP126_VENV) $(PY312_VENV) build *.egg-info
