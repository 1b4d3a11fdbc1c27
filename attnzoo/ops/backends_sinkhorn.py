"""Fused Sinkhorn backends register here (imported by attnzoo.functional after the references)."""
