"""Built-in generated data: a learnable sequence-copy task for language models."""

from __future__ import annotations

import numpy as np

SEPARATOR = 0


def copy_task(num_examples: int, length: int, vocab_size: int, seed: int = 0):
    """Sequences ``a_1..a_T SEP a_1..a_T`` for next-token prediction; only the copied half is scored.

    Returns (inputs, targets, sample_weights), each of shape (N, 2T); tokens are in 1..vocab_size-1.
    """
    rng = np.random.default_rng(seed)
    digits = rng.integers(1, vocab_size, size=(num_examples, length))
    sequence = np.concatenate([digits, np.full((num_examples, 1), SEPARATOR), digits], axis=1)
    inputs, targets = sequence[:, :-1], sequence[:, 1:]
    weights = np.zeros(targets.shape, "float32")
    weights[:, length:] = 1.0  # the copy after the separator is learnable; the prefix is noise
    return inputs.astype("int32"), targets.astype("int32"), weights
