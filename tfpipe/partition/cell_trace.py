"""A cell traced for one input signature: its function, and how to call it and unpack what it returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe.backward import replay
from tfpipe.graph import calls
from tfpipe.leaves import flat


@dataclasses.dataclass
class CellTrace:
    """A cell traced for one input signature: the function and how to unpack its flat outputs."""

    function: Any  # a ConcreteFunction: (inputs, trainable, non-trainable) -> y leaves + changed state + added loss
    y: Any  # the structure of the cell's outputs, with None where an output is None
    y_leaves: list[int]  # positions of the tensor leaves in tf.nest.flatten(y)
    changed: list[int]  # indices of the non-trainable values that the cell assigns

    def apply(self, x: Any, trainable: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor], cheap: bool = False):
        """Call the function: (outputs, new non-trainable values, added losses), as ``Cell.run_inline``.

        ``cheap``: no tape differentiates this call, so it may be made the way that costs the build
        less (``tfpipe.graph.calls``).
        """
        args = self._args(x, trainable, non_trainable)
        return self._unpack(calls.call(self.function, args) if cheap else self.function(*args), non_trainable)

    def replay(self, x: Any, trainable: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor]):
        """What ``apply`` returns, as the function's ops with TensorFlow's gradient of it (backward.replay); or None."""
        outputs = replay.call(self.function, self._args(x, trainable, non_trainable))
        return None if outputs is None else self._unpack(outputs, non_trainable)

    @staticmethod
    def _args(x: Any, trainable: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        xs = [tf.convert_to_tensor(t) for t in flat(x)]
        return [*xs, *trainable, *non_trainable]

    def _unpack(self, outputs: Sequence[tf.Tensor], non_trainable: Sequence[tf.Tensor]):
        """(outputs, new non-trainable values, added losses) from the function's flat outputs."""
        n_y = len(self.y_leaves)
        flat_y: list[Any] = [None] * len(tf.nest.flatten(self.y))
        for position, t in zip(self.y_leaves, outputs[:n_y]):
            flat_y[position] = t
        new_state = list(non_trainable)
        for k, value in zip(self.changed, outputs[n_y:-1]):
            new_state[k] = value
        return tf.nest.pack_sequence_as(self.y, flat_y), new_state, outputs[-1]
