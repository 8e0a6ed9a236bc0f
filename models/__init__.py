"""Reference models written as sequences of Keras layers, ready for tfpipe.PipelineModel."""
