"""Non-trainable state across micro-batches: a seed per micro-batch, and updates merged once per step.

Two kinds of state change while a layer trains:

- Seed-generator states (Dropout and every other random layer). Micro-batch j
  runs with its own state derived from the step's state (micro-batch 0 with the
  step's state itself, so M=1 draws exactly what plain Keras draws); forward and
  recomputation get the same state, so they draw the same mask. The variable then
  advances once per step, as after one plain call.
- BatchNormalization moving statistics. Each micro-batch normalizes with its own
  statistics; the moving mean and variance are updated once, from the statistics
  of the whole mini-batch, recovered exactly from the per-micro-batch updates.

Any other non-trainable variable that a layer assigns in training cannot be
merged without knowing what it means, so it is an error rather than a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from tfpipe import _compat

SEED_STATE_NAME = "seed_generator_state"


def split_variables(layers: Sequence[keras.layers.Layer]) -> tuple[list[keras.Variable], list[keras.Variable]]:
    """The trainable weights of ``layers`` and their other state, each once, in layer order.

    Trainable: each weight whose own ``trainable`` is set, as Keras' ``Model.trainable_weights`` decides, not each
    layer's (LoRA freezes a decoder block and unfreezes its attention's LoRA weights). The other state: every other
    non-trainable variable (frozen weights, BatchNorm statistics, seed-generator states).
    """
    seen: set[int] = set()
    trainable = []
    for layer in layers:
        for v in layer.weights:
            if v.trainable and id(v) not in seen:
                seen.add(id(v))
                trainable.append(v)
    other = []
    for layer in layers:
        for v in layer.non_trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                other.append(v)
    return trainable, other


def is_seed_state(variable: keras.Variable) -> bool:
    """Whether a variable is the state of a keras.random.SeedGenerator."""
    return variable.name == SEED_STATE_NAME and not variable.dtype.startswith("float")


def seed_states(layers: Sequence[keras.layers.Layer]) -> list[keras.Variable]:
    """The seed-generator states of ``layers``, each once, in layer order."""
    seen: dict[int, keras.Variable] = {}
    for layer in layers:
        for v in layer.variables:
            if is_seed_state(v):
                seen.setdefault(id(v), v)
    return list(seen.values())


def micro_batch_seed(state: tf.Tensor, micro_batch: int | tf.Tensor) -> tf.Tensor:
    """The seed state micro-batch j runs with: the step's own for j=0, a folded-in one otherwise.

    ``micro_batch`` may be a scalar tensor (inside a loop over micro-batches).
    """
    if isinstance(micro_batch, int) and micro_batch == 0:
        return state
    folded = tf.cast(tf.random.experimental.stateless_fold_in(tf.cast(state, tf.int64), micro_batch), state.dtype)
    if isinstance(micro_batch, int):
        return folded
    return tf.where(tf.equal(micro_batch, 0), state, folded)


def micro_batch_states(
    variables: Sequence[keras.Variable], values: Sequence[tf.Tensor], micro_batch: int | tf.Tensor
) -> list[tf.Tensor]:
    """The non-trainable ``values`` micro-batch j runs with: each seed-generator state its own, the rest as given."""
    return [micro_batch_seed(s, micro_batch) if is_seed_state(v) else s for v, s in zip(variables, values)]


class StateMerger:
    """Knows which non-trainable variables of a group of layers change in training, and how to merge them."""

    def __init__(self, layers: Sequence[keras.layers.Layer]):
        self._bn: dict[int, tuple[str, float, int]] = {}  # id(var) -> (role, momentum, id(moving_mean))
        self._owner: dict[int, str] = {}
        for layer in layers:
            for sub in _compat.flatten_layers(layer):
                for v in sub.variables:
                    self._owner.setdefault(id(v), sub.name)
                if isinstance(sub, keras.layers.BatchNormalization) and not getattr(sub, "renorm", False):
                    mean_id = id(sub.moving_mean)
                    self._bn[mean_id] = ("mean", float(sub.momentum), mean_id)
                    self._bn[id(sub.moving_variance)] = ("variance", float(sub.momentum), mean_id)

    def merge(
        self,
        variables: Sequence[keras.Variable],
        old: Sequence[tf.Tensor],
        new_per_micro_batch: Sequence[Sequence[tf.Tensor]],
        fractions: Sequence[tf.Tensor],
    ) -> list[tuple[keras.Variable, tf.Tensor]]:
        """The (variable, value) assignments of one step, from every micro-batch's new values.

        ``new_per_micro_batch[j][k]`` is micro-batch j's value of ``variables[k]``
        after its forward; it is ``old[k]`` itself (the same tensor) when unchanged.
        ``fractions[j]`` is n_j / N.
        """
        index = {id(v): k for k, v in enumerate(variables)}
        updates = []
        for k, v in enumerate(variables):
            news = [nb[k] for nb in new_per_micro_batch]
            if all(n is old[k] for n in news):
                continue
            if is_seed_state(v):
                updates.append((v, news[0]))  # micro-batch 0 ran with the step's own state
            elif id(v) in self._bn:
                role, momentum, mean_id = self._bn[id(v)]
                shares = [tf.cast(f, v.dtype) for f in fractions]  # n_j / N are float32; a float64 model's state is not
                merged = tf.add_n([f * n for f, n in zip(shares, news)])
                if role == "variance" and momentum < 1.0:
                    means = [nb[index[mean_id]] for nb in new_per_micro_batch]
                    mean = tf.add_n([f * n for f, n in zip(shares, means)])
                    # (1-m) * sum_j f_j (mu_j - mu)^2, with mu_j - mu = (mean'_j - mean') / (1-m)
                    spread = tf.add_n([f * tf.square(n - mean) for f, n in zip(shares, means)])
                    merged = merged + spread / (1.0 - momentum)
                updates.append((v, merged))
            else:
                raise ValueError(
                    f"Layer {self._owner.get(id(v), '?')!r} assigns its non-trainable variable {v.path!r} in "
                    "training; tfpipe knows how to merge only seed-generator states and BatchNormalization "
                    "moving statistics (without renorm) across micro-batches. Use num_micro_batches=1, or "
                    "make the variable trainable=False state that is not assigned during training."
                )
        return updates
