"""The constructor's defaults are written once: ``settings.PLANNED_DEFAULTS`` is what its signature says."""

import inspect

import tfpipe
from tfpipe import settings


def test_planned_defaults_are_the_constructors():
    signature = inspect.signature(tfpipe.PipelineModel.__init__).parameters
    assert {name: signature[name].default for name in settings.PLANNED_DEFAULTS} == settings.PLANNED_DEFAULTS


def test_the_model_is_registered_for_keras_loading():
    import keras

    assert keras.saving.get_registered_name(tfpipe.PipelineModel) == "tfpipe>PipelineModel"
    assert keras.saving.get_registered_object("tfpipe>PipelineModel") is tfpipe.PipelineModel
