"""Every quant format family; importing this package registers their codecs in `ikquant.types`."""

from ikquant.formats import floats, legacy  # noqa: F401
