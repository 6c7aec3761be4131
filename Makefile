# The two commands of the README. Each finds or makes a Python with what it needs
# (scripts/env.sh) and then runs. STACK=newest runs them on the newest supported versions
# (Python 3.12, triton 3.9, jax 0.12, jax-triton 0.4, torch 2.15) instead of the oldest.
STACK ?=
PYTHON ?= $(shell FA_STACK=$(STACK) ./scripts/env.sh)
ifeq ($(strip $(PYTHON)),)
$(error scripts/env.sh found or made no usable Python; see its messages above)
endif
WORKERS ?= 2

.PHONY: demo test bench

demo:
	$(PYTHON) examples/parity_demo.py

test:
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n $(WORKERS) tests
	FA_STACK=$(STACK) ./scripts/jax_only.sh

bench:
	$(PYTHON) benchmarks/bench.py
