"""Argument checks shared by every module: one rule, one exception type, one message shape."""

from __future__ import annotations

from typing import Any

import numpy as np


def positive_int(name: str, value: Any, fix: str = "") -> int:
    """``value`` as an int if it is an integer >= 1 (bools are not), else a ValueError naming it and ``fix``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.{' ' + fix if fix else ''}")
    return int(value)
