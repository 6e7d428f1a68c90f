"""Native kernels behind the model's seams (see native.py)."""
