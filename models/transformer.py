"""A decoder-only Transformer language model as a list of layers: embedding, L blocks, output projection."""

from __future__ import annotations

import keras


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
        return {**super().get_config(), "vocab_size": self.vocab_size, "max_length": self.max_length,
                "dim": self.dim}


class TransformerBlock(keras.layers.Layer):
    """Pre-norm block: causal self-attention and a feed-forward network, each with a residual."""

    def __init__(self, dim: int, hidden: int, heads: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.hidden, self.heads, self.dropout = dim, hidden, heads, dropout
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=dropout)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.up = keras.layers.Dense(hidden, activation="gelu")
        self.down = keras.layers.Dense(dim)
        self.drop = keras.layers.Dropout(dropout)

    def call(self, x, training=False):
        h = self.norm1(x)
        x = x + self.attention(h, h, use_causal_mask=True, training=training)
        return x + self.drop(self.down(self.up(self.norm2(x))), training=training)

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "hidden": self.hidden, "heads": self.heads,
                "dropout": self.dropout}


def transformer_lm(vocab_size: int, max_length: int, num_blocks: int = 4, dim: int = 64, hidden: int = 256,
                   heads: int = 4, dropout: float = 0.0) -> list[keras.layers.Layer]:
    """Layers of T(L, H, A): embedding, ``num_blocks`` blocks, final norm, projection to the vocabulary."""
    if dim % heads:
        raise ValueError(f"dim={dim} must be divisible by heads={heads}.")
    return ([TokenAndPositionEmbedding(vocab_size, max_length, dim)]
            + [TransformerBlock(dim, hidden, heads, dropout) for _ in range(num_blocks)]
            + [keras.layers.LayerNormalization(epsilon=1e-5), keras.layers.Dense(vocab_size)])
