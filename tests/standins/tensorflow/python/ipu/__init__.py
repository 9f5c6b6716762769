"""Part of the stand-in for Graphcore's TensorFlow (tensorflow/__init__.py)."""
