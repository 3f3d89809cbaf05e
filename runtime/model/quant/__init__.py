"""Quantized checkpoints: one file per format, the decision of what a checkpoint holds in
``spec.py``, the layer plumbing in ``linear_method.py``."""
