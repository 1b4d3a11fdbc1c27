"""attnzoo's own model testers for transformers' shared model tests (benchmarks/hf_common_tests.py).

transformers' PyPI sdist ships tests/test_modeling_common.py (the ModelTesterMixin every model's tests
mix in) and tests/test_training_mixin.py, but not the per-model tests that drive them, nor the modules
test_modeling_common imports beside them. The files here fill those places in a temporary tree; they are
written for attnzoo (a tiny config and inputs per model, nothing copied from transformers) and are never
imported from here: LAYOUT says where each one goes in the tree, and only there do their relative
imports resolve.
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHITECTURES = ("gemma2", "gpt_oss", "mistral", "qwen2")

# file here -> its place in the tree (relative to the tree's root)
LAYOUT = {
    "causal_lm_tester.py": "tests/causal_lm_tester.py",
    # test_modeling_common imports these two mixins; their tests (generate, torch.export) are not run here
    "absent_mixins.py": ("tests/generation/test_utils.py", "tests/exporters/test_export.py"),
    **{f"{a}.py": f"tests/models/{a}/test_modeling_{a}.py" for a in ARCHITECTURES},
}

# the environment variable by which the runner's --sliding-window reaches the testers (causal_lm_tester,
# imported as the tree's tests.causal_lm_tester, cannot import this package: it repeats the name)
WINDOW = "ATTNZOO_HF_SLIDING_WINDOW"

# what the tree takes from the sdist (its root is transformers-<version>/)
FROM_SDIST = ("tests/test_modeling_common.py", "tests/test_training_mixin.py")
