"""What the user hands in, cut into cells: layer sequences, Functional graphs, cells and their state.

Internal: the public API is what tfpipe.__all__ names.
"""
