PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench docs notebooks fuzz clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch's CPU wheel: from the local wheel folder when the machine has one, else PyTorch's CPU index
	if [ -d /opt/wheels ]; then $(BIN)/pip install --quiet --find-links /opt/wheels "torch==2.13.0"; \
	else $(BIN)/pip install --quiet "torch>=2.13,<2.14" --index-url https://download.pytorch.org/whl/cpu; fi
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(BIN)/python -m runtime.demo

test: setup
	$(BIN)/python -m pytest -q -n 2

lint: setup
	$(BIN)/ruff check .

# coverage-guided fuzzing from a fresh random seed (the test suite runs a fixed seed); finds land in fuzz/
FUZZ_SECONDS ?= 600
fuzz: setup
	mkdir -p fuzz/corpus fuzz/found
	$(BIN)/python tests/fuzz/fuzz_build.py fuzz/corpus -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/found/ \
		-rss_limit_mb=4096 -timeout=20 -print_final_stats=1

bench: setup
	$(BIN)/python -m benchmarks

# the generated parts of docs/ (help blocks of docs/cli.md, docs/images/, docs/ops.md); tests fail when stale
docs: setup
	$(BIN)/python tests/test_docs.py
	$(BIN)/gradbuilder ops --markdown > docs/ops.md

# re-execute the notebooks in place, refreshing their committed outputs
notebooks: setup
	$(BIN)/python tests/test_notebooks.py

clean:
	rm -rf $(VENV) build *.egg-info
