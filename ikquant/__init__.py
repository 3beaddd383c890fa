"""ik_llama.cpp's GGUF file and number formats: type registry, GGUF I/O, quantization formats and recipes."""

import os

# OpenBLAS's worker threads spin for 2^28 cycles after each call (~0.1 s), and the runtime alternates BLAS with
# Numba's parallel kernels on the same cores: a spinning BLAS thread halves every kernel that follows (measured:
# --numerics ik on Q8_0 381 -> 721 tok/s, exact F16 340 -> 367 on 2 threads). OpenBLAS reads this when it loads, so
# it is set before anything here imports numpy; a value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
