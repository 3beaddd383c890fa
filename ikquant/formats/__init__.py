"""Every quant format family; importing this package registers their codecs in `ikquant.types`."""

from ikquant.formats import (  # noqa: F401
    bitnet,
    floats,
    interleaved,
    iq1_r4,
    iq4,
    iq12,
    iqk,
    iqk_ks,
    iquants,
    kquants,
    legacy,
    mxfp4,
    rowscaled,
    trellis,
)
