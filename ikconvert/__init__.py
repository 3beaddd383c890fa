import ikquant  # noqa: F401  (its import sets the BLAS thread timeout and the Numba cache folder before they load)
