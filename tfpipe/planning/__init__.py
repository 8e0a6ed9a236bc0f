"""Choosing the cut: per-layer FLOPs and measured costs, the balance, the summary table."""
