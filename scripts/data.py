"""Training data for the main job: generated learnable tasks, or a tensorflow-datasets data set made to fit."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

SEPARATOR = 0  # in the copy task: between the sequence and its copy; in text: padding
BYTE_VOCAB = 257  # byte-level text: 0 pads, byte b is token b + 1


def copy_task(num_examples: int, length: int, vocab_size: int, seed: int = 0):
    """Sequences ``a_1..a_T SEP a_1..a_T`` for next-token prediction; only the copied half is scored.

    Returns (inputs, targets, sample_weights), each of shape (N, 2T); tokens are in 1..vocab_size-1.
    """
    digits = np.random.default_rng(seed).integers(1, vocab_size, size=(num_examples, length))
    return _answer_after(digits, digits)


def sort_task(num_examples: int, length: int, vocab_size: int, seed: int = 0):
    """Sequences ``a_1..a_T SEP sorted(a)``: as ``copy_task``, but the answer is the tokens in order.

    Harder than copying: each answer token depends on how many of every smaller token came
    before, so a small Transformer keeps improving over several epochs instead of one.
    """
    digits = np.random.default_rng(seed).integers(1, vocab_size, size=(num_examples, length))
    return _answer_after(digits, np.sort(digits, axis=1))


def _answer_after(question: np.ndarray, answer: np.ndarray):
    """(inputs, targets, weights) of ``question SEP answer`` for next-token prediction, the answer scored."""
    n, length = question.shape
    sequence = np.concatenate([question, np.full((n, 1), SEPARATOR), answer], axis=1)
    inputs, targets = sequence[:, :-1], sequence[:, 1:]
    weights = np.zeros(targets.shape, "float32")
    weights[:, length:] = 1.0  # the answer after the separator is learnable; the question is noise
    return inputs.astype("int32"), targets.astype("int32"), weights


def pattern_images(num_examples: int, size: int, num_classes: int, seed: int = 0, noise: float = 1.0):
    """Images whose class is a smooth random pattern under Gaussian noise: learnable by any conv net.

    Returns (images float32 (N, size, size, 3), labels int32 (N,)).
    """
    rng = np.random.default_rng(seed)
    coarse = rng.normal(size=(num_classes, 4, 4, 3))
    templates = np.repeat(np.repeat(coarse, -(-size // 4), axis=1), -(-size // 4), axis=2)[:, :size, :size]
    labels = rng.integers(0, num_classes, size=num_examples)
    images = templates[labels] + noise * rng.normal(size=(num_examples, size, size, 3))
    return images.astype("float32"), labels.astype("int32")


def shapes_segmentation(num_examples: int, size: int, seed: int = 0, noise: float = 0.5):
    """Noisy images of a bright rectangle and a dark disc; the target marks the rectangle's pixels.

    Learnable by a U-Net (it must tell the two shapes apart, not only find bright pixels).
    Returns (images float32 (N, size, size, 3), masks float32 (N, size, size, 1)).
    """
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[:size, :size]
    images = noise * rng.normal(size=(num_examples, size, size, 3))
    masks = np.zeros((num_examples, size, size, 1))
    for n in range(num_examples):
        top, left = rng.integers(0, size // 2, size=2)
        height, width = rng.integers(size // 4, size // 2 + 1, size=2)
        box = (rows >= top) & (rows < top + height) & (cols >= left) & (cols < left + width)
        cy, cx, radius = rng.integers(0, size), rng.integers(0, size), rng.integers(size // 8 + 1, size // 4 + 2)
        disc = (rows - cy) ** 2 + (cols - cx) ** 2 <= radius**2
        images[n][disc] += 1.5
        images[n][box] += 1.5
        masks[n, ..., 0] = box
    return images.astype("float32"), masks.astype("float32")


@dataclasses.dataclass
class TfdsData:
    """A tensorflow-datasets split made into batches of (inputs, targets[, weights]) for one model kind."""

    dataset: Any  # tf.data.Dataset of whole batches
    num_classes: int | None = None  # images
    vocab_size: int | None = None  # text


def parse_tfds(spec: str) -> tuple[str, str]:
    """'tfds:NAME[:SPLIT]' -> (NAME, SPLIT); the split defaults to 'train'."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] != "tfds" or not parts[1]:
        raise ValueError("write 'synthetic' or tfds:NAME[:SPLIT], e.g. tfds:mnist or tfds:imdb_reviews:train")
    return parts[1], (parts[2] if len(parts) == 3 and parts[2] else "train")


def load_tfds(
    spec: str, kind: str, batch_size: int, data_dir: str | None, image_size: int, seq_len: int, seed: int = 0
) -> TfdsData:
    """Load ``tfds:NAME[:SPLIT]`` and preprocess it for ``kind`` ("image" or "text").

    Images: the first image feature, resized to ``image_size`` square, 3 channels, scaled to [0, 1],
    with the "label" feature. Text: the first text feature as bytes, cut or padded to
    ``seq_len + 1`` tokens, for next-token prediction (padding is not scored).
    """
    import tensorflow as tf
    import tensorflow_datasets as tfds

    name, split = parse_tfds(spec)
    load = dict(split=split, data_dir=data_dir, with_info=True, shuffle_files=False)
    try:
        dataset, info = tfds.load(name, download=False, **load)  # there already (or mocked)
    except AssertionError:  # tensorflow-datasets' "could not find data": download it, if its hosts answer
        _check_downloadable(tfds.builder(name, data_dir=data_dir), name)
        dataset, info = tfds.load(name, **load)
    features = info.features
    if kind == "image":
        image_key = _first_feature(features, tfds.features.Image, "an image", spec)
        if "label" not in features or not isinstance(features["label"], tfds.features.ClassLabel):
            raise ValueError(f"{spec} has no 'label' class feature to train an image classifier on")

        def prepare(example):
            image = tf.image.convert_image_dtype(example[image_key], tf.float32)
            image = tf.image.resize(image, (image_size, image_size))
            if image.shape[-1] == 1:
                image = tf.image.grayscale_to_rgb(image)
            return image, tf.cast(example["label"], tf.int32)

        result = TfdsData(None, num_classes=features["label"].num_classes)
    else:
        text_key = _first_feature(features, tfds.features.Text, "a text", spec)

        def prepare(example):
            ids = tf.io.decode_raw(example[text_key], tf.uint8)[: seq_len + 1]
            ids = tf.cast(ids, tf.int32) + 1
            ids = tf.pad(ids, [[0, seq_len + 1 - tf.shape(ids)[0]]])
            ids = tf.ensure_shape(ids, (seq_len + 1,))
            return ids[:-1], ids[1:], tf.cast(ids[1:] != SEPARATOR, tf.float32)

        result = TfdsData(None, vocab_size=BYTE_VOCAB)
    dataset = dataset.map(prepare, num_parallel_calls=tf.data.AUTOTUNE).shuffle(1024, seed=seed)
    result.dataset = dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return result


def _check_downloadable(builder: Any, name: str) -> None:
    """A data set missing from the data directory whose download hosts are unreachable: one line, not minutes
    of tensorflow-datasets' retries."""
    import socket
    from urllib.parse import urlparse

    if builder.is_prepared():
        return
    hosts = sorted({urlparse(url).hostname for url in (builder.url_infos or {}) if urlparse(url).hostname})
    for host in hosts:
        try:
            socket.create_connection((host, 443), timeout=5).close()
            return
        except OSError:
            continue
    if hosts:
        raise ValueError(
            f"{name} is not in the data directory {builder.data_dir} and cannot be downloaded "
            f"({', '.join(hosts)} unreachable); prepare it where there is a network (tfds build {name} "
            "--data_dir=DIR) and pass --data_dir=DIR"
        )


def _first_feature(features: Any, feature_type: type, what: str, spec: str) -> str:
    for key, feature in features.items():
        if isinstance(feature, feature_type):
            return key
    raise ValueError(f"{spec} has no {what} feature (it has {sorted(features.keys())}); pick a data set that does")


def random_lm(
    batch_size: int, seq_len: int, blocks: int, dim: int, vocab: int = 256, seed: int = 0, tied: bool = False
):
    """A Transformer LM's layers and one batch of random tokens with next-token targets, for timing only.

    Feed-forward width 4*dim, one head per 64 dimensions. Returns (layers, x, y); with ``tied``, a Functional
    model whose output projection is its token embedding (``transformer_lm_tied``) in place of the layers.
    """
    from tfpipe.models.transformer import transformer_lm, transformer_lm_tied

    layers = (transformer_lm_tied if tied else transformer_lm)(vocab, seq_len, blocks, dim, 4 * dim, max(1, dim // 64))
    x = np.random.default_rng(seed).integers(0, vocab, size=(batch_size, seq_len)).astype("int32")
    return layers, x, np.roll(x, -1, axis=1)
