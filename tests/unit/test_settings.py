"""The constructor's defaults are written once: ``settings.PLANNED_DEFAULTS`` is what its signature says."""

import inspect

import tfpipe
from tfpipe import settings


def test_planned_defaults_are_the_constructors():
    signature = inspect.signature(tfpipe.PipelineModel.__init__).parameters
    assert {name: signature[name].default for name in settings.PLANNED_DEFAULTS} == settings.PLANNED_DEFAULTS
