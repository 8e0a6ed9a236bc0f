"""A decoder-only Transformer language model: embedding, L blocks, output projection.

As a list of layers (``transformer_lm``), or as a Functional model whose output projection is the
token embedding itself (``transformer_lm_tied``, weights tied as in GPT-2).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras


@keras.saving.register_keras_serializable(package="tfpipe_models")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab_size: int, max_length: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.max_length, self.dim = vocab_size, max_length, dim
        self.tokens = keras.layers.Embedding(vocab_size, dim)
        self.positions = keras.layers.Embedding(max_length, dim)

    def call(self, ids):
        length = keras.ops.shape(ids)[-1]
        return self.tokens(ids) + self.positions(keras.ops.arange(length))[None]

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "max_length": self.max_length, "dim": self.dim}


def _feed_forward_initializer(scale: float) -> Any:
    """Glorot uniform with every initial weight multiplied by ``scale`` (variance by scale**2)."""
    if scale == 1.0:
        return "glorot_uniform"
    return keras.initializers.VarianceScaling(scale=scale**2, mode="fan_avg", distribution="uniform")


@keras.saving.register_keras_serializable(package="tfpipe_models")
class TransformerBlock(keras.layers.Layer):
    """Pre-norm block: causal self-attention and a feed-forward network, each with a residual.

    ``ffn_init_scale`` multiplies the initial kernels of both feed-forward Dense layers.
    """

    def __init__(self, dim: int, hidden: int, heads: int, dropout: float = 0.0, ffn_init_scale: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.hidden, self.heads, self.dropout = dim, hidden, heads, dropout
        self.ffn_init_scale = ffn_init_scale
        init = _feed_forward_initializer(ffn_init_scale)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=dropout)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.up = keras.layers.Dense(hidden, activation="gelu", kernel_initializer=init)
        self.down = keras.layers.Dense(dim, kernel_initializer=init)
        self.drop = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        shape = tuple(input_shape)
        for norm in (self.norm1, self.norm2):
            norm.build(shape)
        self.attention.build(shape, shape)
        self.up.build(shape)
        self.down.build(shape[:-1] + (self.hidden,))

    def call(self, x, training=False):
        h = self.norm1(x)
        x = x + self.attention(h, h, use_causal_mask=True, training=training)
        return x + self.drop(self.down(self.up(self.norm2(x))), training=training)

    def get_config(self):
        return {
            **super().get_config(),
            "dim": self.dim,
            "hidden": self.hidden,
            "heads": self.heads,
            "dropout": self.dropout,
            "ffn_init_scale": self.ffn_init_scale,
        }


@keras.saving.register_keras_serializable(package="tfpipe_models")
class ClippedDense(keras.layers.Dense):
    """A Dense layer whose outputs (logits) are clipped to [-logit_clip, logit_clip]."""

    def __init__(self, units: int, logit_clip: float, **kwargs):
        logit_clip = _checked_clip(logit_clip)
        super().__init__(units, **kwargs)
        self.logit_clip = logit_clip

    def call(self, inputs, training=None):
        return keras.ops.clip(super().call(inputs, training=training), -self.logit_clip, self.logit_clip)

    def get_config(self):
        return {**super().get_config(), "logit_clip": self.logit_clip}


def _checked_clip(logit_clip: float) -> float:
    if not logit_clip > 0:
        raise ValueError(f"logit_clip={logit_clip!r} must be a positive number, e.g. 15.0.")
    return float(logit_clip)


def _blocks(
    num_blocks: int, dim: int, hidden: int, heads: int, dropout: float, scaled_init: bool, named: bool = False
) -> Iterator[TransformerBlock]:
    """The ``num_blocks`` blocks of both models (named ``block_k`` if ``named``); see ``transformer_lm``.

    Made one at a time: a block's random layers draw their seeds when made, so a Functional model that
    calls (builds) each block before making the next draws its initial weights in that order.
    """
    scale = 1.0 / max(num_blocks, 1) if scaled_init else 1.0
    for k in range(num_blocks):
        name = {"name": f"block_{k}"} if named else {}
        yield TransformerBlock(dim, hidden, heads, dropout, ffn_init_scale=scale, **name)


def transformer_lm(
    vocab_size: int,
    max_length: int,
    num_blocks: int = 4,
    dim: int = 64,
    hidden: int = 256,
    heads: int = 4,
    dropout: float = 0.0,
    *,
    logit_clip: float | None = None,
    scaled_init: bool = False,
) -> list[keras.layers.Layer]:
    """Layers of T(L, H, A): embedding, ``num_blocks`` blocks, final norm, projection to the vocabulary.

    The projection outputs logits: train with ``transformer_loss()``. The two options are
    GPipe's remedies for deep stacks (section 5, "Trainability Challenges"):

    - ``logit_clip=c`` clips the logits to [-c, c] (c = 15, say) inside the output
      projection, which becomes a ``ClippedDense``; the layer count stays the same.
    - ``scaled_init=True``: "following Fixup, we scale down the initialization of all
      transformer feed-forward layers by the number of layers": both feed-forward
      kernels of every block start as Glorot uniform draws multiplied by 1/num_blocks.
    """
    if dim % heads:
        raise ValueError(f"dim={dim} must be divisible by heads={heads}.")
    projection = (
        keras.layers.Dense(vocab_size) if logit_clip is None else ClippedDense(vocab_size, logit_clip=logit_clip)
    )
    return (
        [TokenAndPositionEmbedding(vocab_size, max_length, dim)]
        + list(_blocks(num_blocks, dim, hidden, heads, dropout, scaled_init))
        + [keras.layers.LayerNormalization(epsilon=1e-5), projection]
    )


@keras.saving.register_keras_serializable(package="tfpipe_models")
class AddPositions(keras.layers.Layer):
    """Adds a learned position embedding to a sequence of token embeddings."""

    def __init__(self, max_length: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.max_length, self.dim = max_length, dim
        self.positions = keras.layers.Embedding(max_length, dim)

    def build(self, input_shape):
        self.positions.build((None,))

    def call(self, x):
        return x + self.positions(keras.ops.arange(keras.ops.shape(x)[-2]))[None]

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length, "dim": self.dim}


def transformer_lm_tied(
    vocab_size: int,
    max_length: int,
    num_blocks: int = 4,
    dim: int = 64,
    hidden: int = 256,
    heads: int = 4,
    dropout: float = 0.0,
    *,
    logit_clip: float | None = None,
    scaled_init: bool = False,
) -> keras.Model:
    """``transformer_lm`` whose output projection is the token embedding, transposed: a Functional model.

    One ``keras.layers.ReversibleEmbedding`` embeds the tokens and, called again with
    ``reverse=True`` after the final norm, gives the logits (weights tied as in GPT-2, and no
    separate vocabulary projection). ``PipelineModel`` puts its first call in the first cell and
    its second in the last, and sums the two calls' gradients where the table lives. Options as
    for ``transformer_lm``.
    """
    if dim % heads:
        raise ValueError(f"dim={dim} must be divisible by heads={heads}.")
    clip = None if logit_clip is None else _checked_clip(logit_clip)
    tokens = keras.layers.ReversibleEmbedding(vocab_size, dim, name="tokens")
    ids = keras.Input((max_length,), dtype="int32", name="ids")
    x = AddPositions(max_length, dim, name="positions")(tokens(ids))
    for block in _blocks(num_blocks, dim, hidden, heads, dropout, scaled_init, named=True):
        x = block(x)
    logits = tokens(keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x), reverse=True)
    if clip is not None:
        logits = keras.ops.clip(logits, -clip, clip)
    return keras.Model(ids, logits, name="transformer_lm_tied")


def transformer_loss() -> keras.losses.Loss:
    """The loss for ``transformer_lm`` logits and integer next-token targets."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
