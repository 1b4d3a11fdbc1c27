"""Fused linear-attention and OT-attention backends register here (imported by attnzoo.functional)."""
