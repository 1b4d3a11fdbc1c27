"""Fused backends for softmax, l2, fenchel (first order), sigmoid and relu register here
(imported by attnzoo.functional after the references)."""
