"""Deprecated alias of ``tfpipe.cell`` (renamed so that K has one name: cells)."""

import warnings

from tfpipe.cell import Cell

warnings.warn("tfpipe.stage is renamed tfpipe.cell; import Cell from tfpipe.cell.", DeprecationWarning, stacklevel=2)

__all__ = ["Cell"]
