"""Graph optimizations that change no result: lean call ops, Grappler-slimmed bodies, CPU gradients.

Internal: the public API is what tfpipe.__all__ names.
"""
