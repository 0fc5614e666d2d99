# Two commands for a fresh machine: `make demo` and `make test`.
# They create .venv with Python 3.12 if missing. On a machine whose Python
# already has jax (e.g. the GPU machine), pass PYTHON=python3 to skip the venv.

PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
            $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PYTHON ?= $(VENV)/bin/python
JOBS ?= 2

.PHONY: demo test env

env:
ifeq ($(PYTHON),$(VENV)/bin/python)
	@test -n "$(PY312)" || { echo "Python 3.12 not found"; exit 1; }
	@test -x $(VENV)/bin/python || $(PY312) -m venv $(VENV)
	@$(VENV)/bin/python -c 'import tokamax, pytest, xdist, hypothesis' 2>/dev/null || \
	  $(VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
endif

demo: env
	$(PYTHON) scripts/demo.py

test: env
	$(PYTHON) -m pytest -q -n $(JOBS) tests
