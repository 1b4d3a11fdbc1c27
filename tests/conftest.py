import os

import pytest
import torch

# The suite runs on CPU; two threads match CI's machine and keep timings stable.
torch.set_num_threads(min(2, os.cpu_count() or 1))

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreted kernels round to bf16 as a GPU does
    from tests.interpreter_rounding import install
    install()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    # tests monkeypatch module constants that backend choices read (size thresholds, ranked devices):
    # each test starts without the decisions kept for earlier call signatures (attnzoo/ops/plan.py)
    from attnzoo.ops import plan
    plan.clear()
    yield


@pytest.fixture
def one_thread():
    """Tiny ops and models on a shared 2-core machine: a second intra-op thread mostly waits at
    barriers. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_per_length(monkeypatch):
    """Packed calls: the per-length routes (ops/varlen.py's, which read the offsets on the host) fail if taken."""
    from attnzoo.ops import varlen

    def fail(*args, **kwargs):
        raise AssertionError("the per-length route ran")

    monkeypatch.setattr(varlen, "per_sequence", fail)
    monkeypatch.setattr(varlen, "per_sequence_reading_offsets", fail)
