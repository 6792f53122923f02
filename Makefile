# Everything a fresh machine needs: a virtual environment with the package, Fashion-MNIST, and timm's own model
# tests (from the sdist of the installed timm, which tests/test_timm_models.py runs on patchnorm builds).
PYTHON ?= python3
VENV ?= .venv
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
TIMM_TESTS := .timm-tests

.PHONY: setup demo test bench timm-tests

setup: $(VENV)/.installed $(FASHION_MNIST) timm-tests

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

# timm's tests are not committed here: fetched for the installed version (no-op once present)
timm-tests: $(VENV)/.installed
	@version=$$($(VENV)/bin/python -c 'import timm; print(timm.__version__)'); \
	if [ ! -f $(TIMM_TESTS)/timm-$$version/tests/test_models.py ]; then \
		$(VENV)/bin/pip download -q --no-binary :all: --no-deps "timm==$$version" -d $(TIMM_TESTS) && \
		tar -xzf $(TIMM_TESTS)/timm-$$version.tar.gz -C $(TIMM_TESTS) timm-$$version/tests; \
	fi

$(FASHION_MNIST):
	apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist

demo: setup
	$(VENV)/bin/python scripts/pipeline.py --output runs/demo --overwrite

test: setup
	$(VENV)/bin/python -m pytest -q

bench: setup
	$(VENV)/bin/python scripts/bench_layers.py
