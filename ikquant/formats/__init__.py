"""Every quant format family; importing this package registers their codecs in `ikquant.types`."""

from ikquant.formats import floats, iq4, iqk, iqk_ks, kquants, legacy, mxfp4, rowscaled, trellis  # noqa: F401
