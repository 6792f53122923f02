# Everything a fresh machine needs: the package built as a wheel and installed (not editable) in a virtual
# environment, Fashion-MNIST, and timm's own model tests (from the sdist of the installed timm, which
# tests/test_timm_models.py runs on patchnorm builds). The tests run against that install, from outside the
# source tree.
PYTHON ?= python3
VENV ?= .venv
DIST ?= dist
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
VERSION := $(shell sed -n "s/^__version__ = '\(.*\)'/\1/p" timm_affinediv/version.py)
WHEEL := $(DIST)/timm_affinediv-$(VERSION)-py3-none-any.whl
SOURCES := pyproject.toml LICENSE README.md $(wildcard timm_affinediv/*.py timm_affinediv/*/*.py timm_affinediv/*/*/*.py model_cards/*)
BIN := $(abspath $(VENV))/bin
TIMM_TESTS := .timm-tests

.PHONY: setup wheel demo lint test bench timm-tests

setup: $(VENV)/.installed $(FASHION_MNIST) timm-tests

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

wheel: $(WHEEL)

$(WHEEL): $(SOURCES) | $(BIN)/python
	rm -rf build $(DIST)/timm_affinediv-*.whl  # setuptools would carry stale files over from build/
	$(BIN)/pip wheel -q --no-deps -w $(DIST) .

# the dependencies (and the dev extra) from the wheel's metadata, then the wheel itself, replacing any earlier
# install of the same version (an editable one included)
$(VENV)/.installed: $(WHEEL)
	$(BIN)/pip install -q "$(abspath $(WHEEL))[dev]"
	$(BIN)/pip install -q --force-reinstall --no-deps $(WHEEL)
	touch $@

# timm's tests are not committed here: fetched for the installed version (no-op once present)
timm-tests: $(VENV)/.installed
	@version=$$($(BIN)/python -c 'import timm; print(timm.__version__)'); \
	if [ ! -f $(TIMM_TESTS)/timm-$$version/tests/test_models.py ]; then \
		$(BIN)/pip download -q --no-binary :all: --no-deps "timm==$$version" -d $(TIMM_TESTS) && \
		tar -xzf $(TIMM_TESTS)/timm-$$version.tar.gz -C $(TIMM_TESTS) timm-$$version/tests; \
	fi

$(FASHION_MNIST):
	apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist

demo: setup
	$(BIN)/timm-affinediv pipeline --output runs/demo --overwrite

# ruff (the dev extra) on the package, the tests and the scripts; its settings are in pyproject.toml
lint: $(VENV)/.installed
	$(BIN)/ruff check .

# from an empty directory, so that only the installed package can be imported
test: setup lint
	cd "$$(mktemp -d)" && TIMM_AFFINEDIV_WHEEL_TEST=1 $(BIN)/python -m pytest -q -n auto -p no:cacheprovider --rootdir "$(CURDIR)" "$(CURDIR)/tests"

bench: setup
	$(BIN)/python scripts/bench.py
