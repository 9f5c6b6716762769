"""A stand-in for Graphcore's TensorFlow, for testing popdist.tensorflow (it comes only with
the Poplar SDK): just `tensorflow.python.ipu`'s config and utils, see their docstrings."""
