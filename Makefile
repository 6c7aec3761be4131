# The two commands of the README. Each finds or makes a Python with what it needs
# (scripts/env.sh) and then runs.
PYTHON ?= $(shell ./scripts/env.sh)
ifeq ($(strip $(PYTHON)),)
$(error scripts/env.sh found or made no usable Python; see its messages above)
endif
WORKERS ?= 2

.PHONY: demo test bench

demo:
	$(PYTHON) examples/parity_demo.py

test:
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n $(WORKERS) tests
	./scripts/jax_only.sh

bench:
	$(PYTHON) benchmarks/bench.py
