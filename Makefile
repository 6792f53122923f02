# Everything a fresh machine needs: a virtual environment with the package, and Fashion-MNIST.
PYTHON ?= python3
VENV ?= .venv
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: setup demo test bench

setup: $(VENV)/.installed $(FASHION_MNIST)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

$(FASHION_MNIST):
	apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist

demo: setup
	$(VENV)/bin/python scripts/pipeline.py --output runs/demo --overwrite

test: setup
	$(VENV)/bin/python -m pytest -q

bench: setup
	$(VENV)/bin/python scripts/bench_layers.py
