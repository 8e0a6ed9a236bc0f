"""Argument checks shared by every module: one rule, one exception type, one message shape; warnings at the user."""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np


def positive_int(name: str, value: Any, fix: str = "") -> int:
    """``value`` as an int if it is an integer >= 1 (bools are not), else a ValueError naming it and ``fix``."""
    return int_at_least(name, value, 1, fix)


def int_at_least(name: str, value: Any, low: int, fix: str = "") -> int:
    """``value`` as an int if it is an integer >= ``low`` (bools are not), else a ValueError naming it and ``fix``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.{' ' + fix if fix else ''}")
    return int(value)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that points at the first frame outside tfpipe.

    A fixed level breaks whenever the calls between the user and the warning change.
    """
    frame = inspect.currentframe()
    assert frame is not None  # CPython gives frames (TensorFlow runs on no other Python)
    frame, level = frame.f_back, 1  # the function that warns is level 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
