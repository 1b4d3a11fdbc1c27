# `make test` and `make demo` create .venv with pip on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install clean test-oldest-torch test-hf-common

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

# The compile tests (the packed Sinkhorn ones too) again on the oldest torch pyproject allows (the GPU
# image's torch 2.11, with its Triton 3.6), in a second virtual environment; .ci/run calls it after
# `make test`. Left out there:
# the Triton kernels under Triton 3.6's interpreter, which cannot run their staged loops (a helper's
# loop bounds reach it as 1-element arrays); those kernels compile with Triton 3.6 for sm_90
# (benchmarks/compile_triton_kernels.py) and ran with it on an H200 (benchmarks/results/gpu/).
OLD := .venv-torch-oldest
OLD_STAMP := $(OLD)/.installed
OLDEST_TORCH := torch==2.11.0 torchvision==0.26.0

$(OLD_STAMP): pyproject.toml
	test -x $(OLD)/bin/python || $(PY) -m venv $(OLD)
	$(OLD)/bin/python -m pip install -q --upgrade pip
	$(OLD)/bin/python -m pip install -q -e ".[dev]" $(OLDEST_TORCH)
	touch $(OLD_STAMP)

test-oldest-torch: $(OLD_STAMP)
	TRITON_INTERPRET=1 $(OLD)/bin/python -m pytest -q -p no:cacheprovider -k "not under_the_interpreter" \
		tests/test_compile.py tests/test_measured_dispatch.py tests/test_sdpa_routing.py tests/test_sinkhorn_varlen_compile.py

# transformers' own model tests (test_modeling_common, for Gemma 2, gpt-oss, Mistral, Qwen 2) as transformers
# runs them, then with attnzoo's softmax as the attention (benchmarks/hf_common_tests.py; docs/swapping.md).
# Not part of `make test`: it needs TRANSFORMERS_SOURCE, the root of a transformers git checkout at the
# installed version, and transformers' test dependency parameterized. The target's status is the attnzoo run's.
# transformers' shared model tests, sdpa baseline then attnzoo: from TRANSFORMERS_SOURCE (a checkout)
# when set, else from the installed version's PyPI sdist (downloaded once: needs the network).
HF_TESTS = $(if $(TRANSFORMERS_SOURCE),--tree "$(TRANSFORMERS_SOURCE)",--sdist)
test-hf-common: $(STAMP)
	$(BIN)/python -m pip install -q parameterized
	-$(BIN)/python benchmarks/hf_common_tests.py $(HF_TESTS) --attention sdpa -q -rf
	$(BIN)/python benchmarks/hf_common_tests.py $(HF_TESTS) --attention attnzoo -q -rf
