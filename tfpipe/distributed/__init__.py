"""Where cells run: device resolution, worker processes and clusters, health checks, explicit sends.

Internal: the public API is what tfpipe.__all__ names.
"""
