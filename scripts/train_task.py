"""What the main job (scripts/train.py) trains, as its flags say: the model's layers, loss, metrics and data."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (not installed)

import dataclasses
from typing import Any

from scripts import hub_models
from scripts.train_flags import FLAGS, UsageError, ints


@dataclasses.dataclass
class Task:
    """What to train: the layers, their loss and metrics, and the data."""

    layers: Any  # a list of layers, or a Functional keras.Model
    loss: Any
    metrics: dict  # keyword arguments for compile: metrics or weighted_metrics
    dataset: Any  # tf.data.Dataset of whole batches: (inputs, targets[, weights])
    input_shape: tuple
    scored: str  # what the accuracy counts
    held_out: Any = None  # batches never trained on (generated tasks), for the report's held-out accuracy


def held_out_examples() -> int:
    """Generated examples kept out of training, on which the report measures accuracy: an eighth, at least a batch."""
    return max(FLAGS.batch_size, FLAGS.examples // 8)


def _batches(arrays: tuple, batch: int, seed: int):
    """The training batches of the first --examples arrays, and the held-out batches of the rest."""
    import tensorflow as tf

    n = FLAGS.examples
    if n < batch:
        raise UsageError(f"--examples={n} is smaller than --batch_size={batch}")
    dataset = tf.data.Dataset.from_tensor_slices(tuple(a[:n] for a in arrays)).shuffle(n, seed=seed)
    held = tf.data.Dataset.from_tensor_slices(tuple(a[n:] for a in arrays))
    # whole batches: each splits into M micro-batches
    return dataset.batch(batch, drop_remainder=True), held.batch(batch, drop_remainder=True)


def _tfds(kind: str):
    from scripts.data import load_tfds

    try:
        return load_tfds(
            FLAGS.dataset, kind, FLAGS.batch_size, FLAGS.data_dir, FLAGS.image_size, FLAGS.seq_len, seed=FLAGS.seed
        )
    except ImportError as err:
        if err.name != "tensorflow_datasets":  # tensorflow-datasets is there; something it imports is not
            raise
        raise UsageError(f"--dataset={FLAGS.dataset} needs tensorflow-datasets: pip install -e '.[data]'") from None
    except Exception as err:  # noqa: BLE001 - unknown names, missing downloads: one line naming the flag
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"--dataset={FLAGS.dataset}: {message}") from None


def make_task() -> Task:
    """The model's layers, loss, metrics and data as the flags say."""
    if FLAGS.model == "transformer" or hub_models.is_hub(FLAGS.model):
        return _language_task()
    if FLAGS.model == "unet":
        return _segmentation_task()
    return _image_task()


def _language_task() -> Task:
    """A Transformer or keras_hub causal LM on the generated sort or copy task, or on a tfds text data set."""
    import keras

    from scripts import data

    if FLAGS.dataset == "synthetic":
        make = data.sort_task if FLAGS.task == "sort" else data.copy_task
        arrays = make(FLAGS.examples + held_out_examples(), FLAGS.seq_len, FLAGS.vocab, seed=FLAGS.seed)
        (dataset, held), vocab = _batches(arrays, FLAGS.batch_size, FLAGS.seed), FLAGS.vocab
        scored = "sorted tokens" if FLAGS.task == "sort" else "copied tokens"
    else:
        loaded = _tfds("text")
        dataset, held, vocab, scored = loaded.dataset, None, loaded.vocab_size, "next bytes"
    length, input_shape = dataset.element_spec[0].shape[1], None
    if hub_models.is_hub(FLAGS.model):  # a keras_hub CausalLM: named inputs, the padding mask among them
        pad = None if FLAGS.dataset == "synthetic" else data.SEPARATOR  # text pads with it; the tasks have none
        dataset, held = (None if d is None else hub_models.lm_batches(d, pad) for d in (dataset, held))
        layers = hub_models.causal_lm(FLAGS.model[4:], vocab, FLAGS.blocks or 4, FLAGS.dim, length, FLAGS.seed)
        input_shape = hub_models.input_spec(length)
    else:
        from tfpipe.models.transformer import transformer_lm, transformer_lm_tied

        make_lm = transformer_lm_tied if FLAGS.tie_embeddings else transformer_lm
        layers = make_lm(
            vocab, length, FLAGS.blocks or 4, FLAGS.dim, FLAGS.hidden, FLAGS.heads, logit_clip=FLAGS.logit_clip
        )
    metrics = {"weighted_metrics": ["accuracy"]}
    return Task(
        layers,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics,
        dataset,
        input_shape or (None, length),
        scored,
        held,
    )


def _segmentation_task() -> Task:
    """The U-Net on the generated shapes-segmentation task."""
    import keras

    from scripts import data
    from tfpipe.models.unet import unet

    size = FLAGS.image_size
    images, masks = data.shapes_segmentation(FLAGS.examples + held_out_examples(), size, seed=FLAGS.seed)
    model = unet((size, size, 3), 1, FLAGS.unet_depth, FLAGS.unet_convs, FLAGS.unet_channels)
    dataset, held = _batches((images, masks), FLAGS.batch_size, FLAGS.seed)
    return Task(
        model,
        keras.losses.BinaryCrossentropy(from_logits=True),
        {"metrics": [keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")]},
        dataset,
        (None, size, size, 3),
        "pixels",
        held,
    )


def _image_task() -> Task:
    """An image classifier (AmoebaNet-D, a keras.applications model or a ResNet) on generated images or tfds."""
    import keras

    from scripts import data

    size = FLAGS.image_size
    if FLAGS.dataset == "synthetic":
        n = FLAGS.examples + held_out_examples()
        images, labels = data.pattern_images(n, FLAGS.image_size, FLAGS.num_classes, seed=FLAGS.seed)
        (dataset, held), classes = _batches((images, labels), FLAGS.batch_size, FLAGS.seed), FLAGS.num_classes
    else:
        loaded = _tfds("image")
        dataset, held, classes = loaded.dataset, None, loaded.num_classes
    return Task(
        _classifier(classes, size),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        {"metrics": ["accuracy"]},
        dataset,
        (None, size, size, 3),
        "images",
        held,
    )


def _classifier(classes: int, size: int) -> Any:
    """The image classifier --model names, for ``classes`` classes of ``size`` x ``size`` images."""
    import keras

    if FLAGS.model == "amoebanet":
        from tfpipe.models.amoebanet import amoebanet_d

        return amoebanet_d(classes, FLAGS.blocks or 3, FLAGS.filters)
    if FLAGS.model.startswith("keras:"):
        name = FLAGS.model[len("keras:") :]
        application = getattr(keras.applications, name, None)
        if not callable(application):
            raise UsageError(f"--model={FLAGS.model}: keras.applications has no model {name!r}, e.g. keras:ResNet50")
        try:
            return application(weights=None, input_shape=(size, size, 3), classes=classes, classifier_activation=None)
        except ValueError as err:
            raise UsageError(f"--model={FLAGS.model}: {str(err).splitlines()[0]}") from None
    from tfpipe.models.resnet import resnet

    return resnet(int(FLAGS.depth), classes, FLAGS.width, stage_blocks=ints("stage_blocks"))
