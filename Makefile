# Two commands on a fresh machine: `make demo` and `make test`. Both set up what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvbridge-deps
PIP    := $(BIN)/python -m pip -q --disable-pip-version-check
PYTEST_ARGS ?=
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
# this machine's pip config names local indexes that may be absent; drop that noise, keep pip's exit status
QUIET  := { grep -v "is ignored: it is neither a file nor a directory" || true; }

# vLLM runs from a venv of its own (its torch differs from SGLang's); the tests start its
# servers from there. Rebuilt when its pins change, a no-op otherwise.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvbridge-deps

.PHONY: install sysdeps test demo bench reliability docs clean vllm-venv mutants

sysdeps:
	@bash scripts/sysdeps.sh

# Re-installs when a pin changes; a no-op otherwise (idempotent).
$(STAMP): requirements/pins.txt requirements/sglang.txt pyproject.toml scripts/sysdeps.sh
	@bash scripts/sysdeps.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/pins.txt 2>&1 | $(QUIET)
	@$(BIN)/python -c "import torch, numpy, msgspec, zmq, hypothesis, mooncake.engine" \
		|| { echo "kvbridge: dependency install failed" >&2; exit 1; }
	$(PIP) install --no-deps -r requirements/sglang.txt 2>&1 | $(QUIET)
	$(PIP) install --no-deps --no-build-isolation -e . 2>&1 | $(QUIET)
	@$(BIN)/python -c "import sglang, kvbridge.layout" \
		|| { echo "kvbridge: package install failed" >&2; exit 1; }
	@touch $@

install: $(STAMP)

$(VLLM_STAMP): requirements/vllm.txt pyproject.toml scripts/vllm_venv.sh
	@VLLM_VENV=$(VLLM_VENV) PYTHON=$(PYTHON) bash scripts/vllm_venv.sh
	@touch $@

vllm-venv: $(VLLM_STAMP)

test: install vllm-venv
	KVBRIDGE_REQUIRE_VLLM=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# every guarantee's tests fail without it (docs/testing.md); in a scratch copy, not part of `make test`
mutants: install
	$(BIN)/python scripts/mutants.py

demo: install
	$(BIN)/kvbridge demo

bench: install
	$(BIN)/kvbridge bench all --json

# docs/reliability.md: every registered section (load figures, fault matrix), regenerated in one go
reliability: install
	$(BIN)/kvbridge report --out docs/reliability.md

# docs/settings.md: the settings reference, generated from the settings classes (tests/core/test_docs.py checks it)
docs: install
	$(BIN)/python scripts/settings_doc.py --out docs/settings.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info .pytest_cache .hypothesis
