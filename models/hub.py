"""Tiny random configurations of keras_hub architectures (no download), for training, benchmarks and tests.

``task(name, ...)`` builds the architecture's task with random weights: a
``CausalLM`` for decoder-only models, a ``TextClassifier`` for encoders, a
``Seq2SeqLM`` for encoder-decoders, with ``preprocessor=None`` (token ids in).
keras_hub is an optional extra (``pip install -e ".[hub]"``); it is imported
only here, when a task is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A keras_hub backbone and task, and how to size the backbone from the common sizes."""

    backbone: str  # class name in keras_hub.models
    task: str
    kind: str  # "causal_lm", "classifier" or "seq2seq"
    sizes: Callable[[int, int, int, int, float], dict[str, Any]]  # (vocab, layers, dim, length, dropout) -> kwargs


def _gpt(vocab: int, layers: int, dim: int, length: int, dropout: float) -> dict[str, Any]:
    return {
        "vocabulary_size": vocab,
        "num_layers": layers,
        "num_heads": 2,
        "hidden_dim": dim,
        "intermediate_dim": 2 * dim,
        "dropout": dropout,
        "max_sequence_length": length,
    }


def _grouped(vocab: int, layers: int, dim: int, length: int, dropout: float) -> dict[str, Any]:
    """Grouped-query attention, rotary positions (Llama, Mistral, Qwen)."""
    return {
        "vocabulary_size": vocab,
        "num_layers": layers,
        "num_query_heads": 4,
        "num_key_value_heads": 2,
        "hidden_dim": dim,
        "intermediate_dim": 2 * dim,
        "dropout": dropout,
    }


def _gemma(vocab: int, layers: int, dim: int, length: int, dropout: float) -> dict[str, Any]:
    return {
        "vocabulary_size": vocab,
        "num_layers": layers,
        "num_query_heads": 2,
        "num_key_value_heads": 1,
        "hidden_dim": dim,
        "intermediate_dim": 2 * dim,
        "head_dim": dim // 2,
        "dropout": dropout,
    }


def _qwen3(vocab: int, layers: int, dim: int, length: int, dropout: float) -> dict[str, Any]:
    return {**_grouped(vocab, layers, dim, length, dropout), "head_dim": dim // 4}


def _phi3(vocab: int, layers: int, dim: int, length: int, dropout: float) -> dict[str, Any]:
    return {**_grouped(vocab, layers, dim, length, dropout), "max_sequence_length": max(length, 16)}


ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture("GPT2Backbone", "GPT2CausalLM", "causal_lm", _gpt),
    "gemma": Architecture("GemmaBackbone", "GemmaCausalLM", "causal_lm", _gemma),
    "llama": Architecture("LlamaBackbone", "LlamaCausalLM", "causal_lm", _grouped),
    "mistral": Architecture("MistralBackbone", "MistralCausalLM", "causal_lm", _grouped),
    "qwen": Architecture("QwenBackbone", "QwenCausalLM", "causal_lm", _grouped),
    "qwen3": Architecture("Qwen3Backbone", "Qwen3CausalLM", "causal_lm", _qwen3),
    "phi3": Architecture("Phi3Backbone", "Phi3CausalLM", "causal_lm", _phi3),
    "opt": Architecture("OPTBackbone", "OPTCausalLM", "causal_lm", _gpt),
    "gpt_neox": Architecture("GPTNeoXBackbone", "GPTNeoXCausalLM", "causal_lm", _gpt),
    "bert": Architecture("BertBackbone", "BertTextClassifier", "classifier", _gpt),
    "roberta": Architecture("RobertaBackbone", "RobertaTextClassifier", "classifier", _gpt),
    "distil_bert": Architecture("DistilBertBackbone", "DistilBertTextClassifier", "classifier", _gpt),
    "bart": Architecture("BartBackbone", "BartSeq2SeqLM", "seq2seq", _gpt),
}


def names() -> list[str]:
    """The architectures ``task`` builds."""
    return sorted(ARCHITECTURES)


def task(
    name: str,
    *,
    vocabulary_size: int = 97,
    num_layers: int = 4,
    hidden_dim: int = 32,
    sequence_length: int = 12,
    dropout: float = 0.0,
    num_classes: int = 3,
    dtype: Any = None,
    seed: int | None = 0,
) -> keras.Model:
    """A keras_hub task of architecture ``name`` with random weights, ``preprocessor=None``.

    ``seed`` (unless None) makes the weights the same on every call.
    """
    import keras_hub  # the hub extra

    if name not in ARCHITECTURES:
        raise ValueError(f"Unknown keras_hub architecture {name!r}; use one of {', '.join(names())}.")
    arch = ARCHITECTURES[name]
    if seed is not None:
        keras.utils.set_random_seed(seed)
    sizes = arch.sizes(vocabulary_size, num_layers, hidden_dim, sequence_length, dropout)
    backbone = getattr(keras_hub.models, arch.backbone)(**sizes, dtype=dtype)
    extra = {"num_classes": num_classes, "dropout": dropout} if arch.kind == "classifier" else {}
    return getattr(keras_hub.models, arch.task)(backbone=backbone, preprocessor=None, **extra)


def inputs(model: keras.Model, n: int, sequence_length: int, vocabulary_size: int, seed: int = 0) -> dict[str, Any]:
    """A batch of ``n`` random token-id inputs for ``model`` (every input it names), the last two positions padded."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mask = np.ones((n, sequence_length), "int32")
    mask[:, -2:] = 0
    batch = {}
    for spec in model.inputs:
        name = spec.name
        if "mask" in name:
            batch[name] = mask
        elif "segment" in name:
            batch[name] = np.zeros((n, sequence_length), "int32")
        else:
            batch[name] = rng.integers(1, vocabulary_size, (n, sequence_length)).astype("int32")
    return batch
