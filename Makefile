# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QWEN_TTS := qwen-tts==0.1.1
# The torch build the project is tested with (a CPU build, from the local wheel); the package itself asks only torch>=2.5.
TORCH := torch==2.13.0

.PHONY: install demo test bench clean

install: $(VENV)/.installed

# What the demo and `rvqspec serve` need and nothing more: torch, the package with its fast-path, demo and serve extras,
# the kernels.
$(VENV)/.demo: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH) 'ninja>=1.11' 'safetensors>=0.4' 'numpy>=1.26,<3'
	# The CPU fast path's kernels build now (~20 s, cached by torch; from this checkout, which imports with the base
	# dependencies) while pip installs the rest, rather than in the first decode; where they cannot be built this
	# warns and decoding takes the plain path.
	$(PY) -c "from rvqspec.core import fused; fused.kernels()" & kernels=$$!; \
		$(PY) -m pip install -q -e '.[fast,demo,serve]' $(TORCH) && wait $$kernels
	touch $@

# Everything else the suite uses: tests, the reference implementations, the stand-in's build and quality tools.
$(VENV)/.installed: $(VENV)/.demo
	$(PY) -m pip install -q -e '.[fast,test,ref,standin,train,bench,demo,serve,ray]' $(TORCH)
	$(PY) -m pip install -q --no-deps $(QWEN_TTS)
	touch $@

# Passive OpenMP workers: spinning ones make a 2-thread run ~10x slower when other jobs share the cores.
demo: $(VENV)/.demo
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/rvqspec demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
