# `make test` and `make demo` create .venv with pip on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,hf,analysis]"
	touch $(STAMP)

install: $(STAMP)

# pytest exits 5 when it collects no test: that is a failure here, as is any other non-zero code.
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests

demo: $(STAMP)
	$(BIN)/python -m attnzoo demo

clean:
	rm -rf $(VENV) .pytest_cache
