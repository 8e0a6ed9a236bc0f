"""The leaves of nested tensor structures, where None marks a leaf that is not a tensor (an optional input)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def flat(structure: Any) -> list[Any]:
    """The leaves of ``structure`` that are not None, in order."""
    return [t for t in tf.nest.flatten(structure) if t is not None]


def fill(structure: Any, leaves: Sequence[Any]) -> list[Any]:
    """The flat leaves of ``structure`` with its non-None leaves replaced, in order, by the first ``leaves``."""
    it = iter(leaves)
    return [None if leaf is None else next(it) for leaf in tf.nest.flatten(structure)]
