import ikquant  # noqa: F401  (its import sets the BLAS thread timeout before numpy loads)
