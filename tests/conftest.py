import os

import pytest
import torch

# The suite runs on CPU; two threads match CI's machine and keep timings stable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
