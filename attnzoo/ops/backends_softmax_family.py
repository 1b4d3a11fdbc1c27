"""torch (SDPA/FlexAttention) and CPU memory-efficient backends for softmax, l2, fenchel, sigmoid and
relu register here (imported by attnzoo.functional after the references)."""
