"""Choosing the cut: per-layer FLOPs and measured costs, the balance, the summary table.

Internal: the public API is what tfpipe.__all__ names.
"""
