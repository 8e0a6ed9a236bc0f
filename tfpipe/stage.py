"""A cell: a contiguous group of layers placed on one device and run as a pure function."""

from __future__ import annotations

from typing import Any, Sequence

import keras
import tensorflow as tf

from tfpipe import devices, state


def _spec_of(x: Any) -> Any:
    return tf.nest.map_structure(lambda t: keras.KerasTensor(tuple(t.shape), dtype=t.dtype), x)


class Cell:
    """Layers ``layers`` on ``device``, callable as ``y = f(weights, state, x)`` without side effects."""

    def __init__(self, index: int, layers: Sequence[keras.layers.Layer], device: str):
        self.index = index
        self.layers = list(layers)
        self.device = device
        self._merger: state.StateMerger | None = None

    # Variables -----------------------------------------------------------------------
    def _unique(self, attr: str) -> list[keras.Variable]:
        seen, out = set(), []
        for layer in self.layers:
            for v in getattr(layer, attr):
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    @property
    def trainable_variables(self) -> list[keras.Variable]:
        """The cell's trainable variables, in layer order."""
        return self._unique("trainable_variables")

    @property
    def non_trainable_variables(self) -> list[keras.Variable]:
        """The cell's other state: frozen weights, BatchNorm statistics, seed-generator states."""
        trainable = {id(v) for v in self.trainable_variables}
        return [v for v in self._unique("non_trainable_variables") if id(v) not in trainable]

    def count_params(self) -> int:
        """Number of scalars in the cell's weights (seed states excluded)."""
        return int(sum(layer.count_params() for layer in self.layers))

    @property
    def merger(self) -> state.StateMerger:
        """How this cell's state updates are merged across micro-batches."""
        if self._merger is None:
            self._merger = state.StateMerger(self.layers)
        return self._merger

    # Building ---------------------------------------------------------------------------
    def build(self, input_spec: Any) -> Any:
        """Create the cell's variables on its device from the input spec; return the output spec."""
        x = input_spec
        with tf.init_scope(), devices.scope(self.device):
            for layer in self.layers:
                x = layer.compute_output_spec(x) if layer.built else layer(x)
        return x

    def read(self) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """Read the current trainable and non-trainable values once, on the cell's device."""
        with devices.scope(self.device):
            trainable = [tf.identity(v.value) for v in self.trainable_variables]
            other = [tf.identity(v.value) for v in self.non_trainable_variables]
        return trainable, other

    def regularization_loss(self, trainable: Sequence[tf.Tensor]) -> tf.Tensor:
        """Sum of the weight regularizers of the cell, evaluated on the given weight values."""
        terms = [
            tf.cast(v.regularizer(w), tf.float32)
            for v, w in zip(self.trainable_variables, trainable)
            if getattr(v, "regularizer", None) is not None
        ]
        return tf.add_n(terms) if terms else tf.constant(0.0)

    # Running ------------------------------------------------------------------------------
    def __call__(
        self,
        trainable: Sequence[tf.Tensor],
        non_trainable: Sequence[tf.Tensor],
        x: Any,
        training: bool,
    ) -> tuple[Any, list[tf.Tensor], tf.Tensor]:
        """Run the layers on given variable values: (outputs, new non-trainable values, added losses).

        Nothing is assigned: Keras' StatelessScope maps every variable to the
        given tensor and collects assignments and ``add_loss`` terms instead.
        """
        mapping = list(zip(self.trainable_variables, trainable)) + list(zip(self.non_trainable_variables, non_trainable))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=training) as scope:
            for layer in self.layers:
                x = layer(x, training=training)
            new_state = [scope.get_current_value(v) for v in self.non_trainable_variables]
            losses = [tf.cast(tf.reduce_sum(loss), tf.float32) for loss in scope.losses] if training else []
        added = tf.add_n(losses) if losses else tf.constant(0.0)
        return x, new_state, added

    def describe(self) -> str:
        """The cell's layers: all names when few, else first and last with the count."""
        names = [layer.name for layer in self.layers]
        if len(names) <= 3:
            return ", ".join(names)
        return f"{names[0]} .. {names[-1]} ({len(names)} layers)"


def check_no_shared_variables(cells: Sequence[Cell]) -> None:
    """A variable used by two cells would get two gradients; refuse it with the fix."""
    owner: dict[int, int] = {}
    for cell in cells:
        for v in cell.trainable_variables + cell.non_trainable_variables:
            other = owner.setdefault(id(v), cell.index)
            if other != cell.index:
                raise ValueError(
                    f"Variable {v.path!r} is used by cells {other} and {cell.index}; tied weights must stay "
                    "in one cell. Change balance so that the layers sharing it are in the same cell."
                )
