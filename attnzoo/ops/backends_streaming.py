"""Fused backends for sinkhorn, linear and ot register here
(imported by attnzoo.functional after the references)."""
