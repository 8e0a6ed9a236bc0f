"""keras_hub causal LMs for the scripts' --model=hub:NAME: tiny random configurations (models/hub.py) and their inputs.

A keras_hub CausalLM takes ``{"token_ids": int32 [n, L], "padding_mask": int32 [n, L]}`` and gives logits
[n, L, vocab]; the generated sequence tasks (scripts/data.py) give token ids and next-token targets, which
``lm_batches`` turns into that dict. keras_hub is the hub extra; it is imported only when a task is built.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

PREFIX = "hub:"
INSTALL = 'pip install -e ".[hub]"'


def is_hub(model: str) -> bool:
    """Whether a --model value names a keras_hub architecture (hub:NAME)."""
    return model.startswith(PREFIX)


def causal_lms() -> list[str]:
    """The architectures of models/hub.py that the scripts train: its causal LMs."""
    from tfpipe.models import hub

    return [name for name in hub.names() if hub.ARCHITECTURES[name].kind == "causal_lm"]


def keras_hub_installed() -> bool:
    """Whether keras_hub can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("keras_hub") is not None
    except (ImportError, ValueError):  # ValueError: in sys.modules as None, i.e. blocked
        return False


def check(model: str) -> str:
    """NAME of --model=hub:NAME; a ValueError naming the fix where it is unknown, no causal LM, or keras_hub missing."""
    from tfpipe.models import hub

    name = model[len(PREFIX) :]
    known = ", ".join(causal_lms())
    if name not in hub.ARCHITECTURES:
        raise ValueError(f"models/hub.py has no keras_hub architecture {name!r}; use hub:NAME, NAME one of {known}")
    arch = hub.ARCHITECTURES[name]
    if arch.kind != "causal_lm":
        what = {"classifier": "a text classifier", "seq2seq": "a sequence-to-sequence model"}.get(arch.kind, arch.kind)
        raise ValueError(
            f"{arch.task} is {what}, not a causal LM; the scripts train causal LMs on the generated language task: "
            f"hub:NAME, NAME one of {known}"
        )
    if not keras_hub_installed():
        raise ValueError(f"needs keras_hub, the hub extra: {INSTALL}")
    return name


def causal_lm(name: str, vocab: int, layers: int, dim: int, length: int, seed: int = 0) -> Any:
    """A tiny random keras_hub CausalLM ``name`` (no preprocessor): ``layers`` blocks of width ``dim``.

    ImportError naming the extra where keras_hub is missing.
    """
    from tfpipe.models import hub

    try:
        return hub.task(
            name, vocabulary_size=vocab, num_layers=layers, hidden_dim=dim, sequence_length=length, seed=seed
        )
    except ModuleNotFoundError as err:
        if err.name != "keras_hub":  # keras_hub is there; something it imports is not
            raise
        raise ImportError(f"--model=hub:{name} needs keras_hub, the hub extra: {INSTALL}", name="keras_hub") from None


def input_spec(length: int) -> dict[str, Any]:
    """A CausalLM's symbolic inputs for sequences of ``length`` tokens, as ``PipelineModel.build`` takes them."""
    import keras

    return {key: keras.KerasTensor((None, length), "int32") for key in ("token_ids", "padding_mask")}


def lm_inputs(token_ids: Any, pad: int | None = None) -> dict[str, Any]:
    """A CausalLM's inputs for ``token_ids`` (numpy or tensor): every position real, or all but the ``pad`` tokens."""
    if isinstance(token_ids, np.ndarray):
        mask = np.ones_like(token_ids) if pad is None else (token_ids != pad).astype("int32")
        return {"token_ids": token_ids.astype("int32"), "padding_mask": mask.astype("int32")}
    import tensorflow as tf

    token_ids = tf.cast(token_ids, tf.int32)
    mask = tf.ones_like(token_ids) if pad is None else tf.cast(token_ids != pad, tf.int32)
    return {"token_ids": token_ids, "padding_mask": mask}


def lm_batches(dataset: Any, pad: int | None = None) -> Any:
    """Batches of (token ids, targets, weights) as a CausalLM takes them: ({token_ids, padding_mask}, targets, weights).

    The weights stay the task's (only what is learnable is scored); ``pad`` as for ``lm_inputs``.
    """
    return dataset.map(lambda ids, *rest: (lm_inputs(ids, pad), *rest))


def random_batch(n: int, length: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One batch of ``n`` random token sequences for timing a CausalLM: (token ids, next-token targets)."""
    ids = np.random.default_rng(seed).integers(1, vocab, size=(n, length + 1)).astype("int32")
    return ids[:, :-1], ids[:, 1:]


class FitOnTokenIds:
    """A CausalLM's ``fit`` that takes its token ids as one array and adds the padding mask (every token real).

    For report's warm_up and timed_fit, which slice, repeat and count one input array and only call ``fit``.
    """

    def __init__(self, model: Any) -> None:
        """Wrap ``model``, a CausalLM or a PipelineModel of one."""
        self.model = model

    def fit(self, x: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        """``model.fit`` on ``{"token_ids": x, "padding_mask": ones}``."""
        return self.model.fit(lm_inputs(x), *args, **kwargs)
