"""Numba kernels of the forward pass: norms, rope, attention softmax, activations."""
