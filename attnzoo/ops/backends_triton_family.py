"""Triton backends for softmax, l2, fenchel, sigmoid and relu register here (imported by attnzoo.functional)."""
