"""`--numerics ik-avx2`: ik's CPU arithmetic as its AVX2 build computes it (no AVX-512: `HAVE_FANCY_SIMD` undefined),
to get the numbers an AVX2 machine's llama-perplexity prints.

It differs from the AVX-512 build's (arithmetic.py) in its float kernels, which sum in 8 lanes and add them as 4 + 4,
then (0 + 2) + (1 + 3) (ikgemm.py; bf16 weights too, on unrounded float32 activations), in its exponential
(ik_expf_avx2: the softmax and the SiLU, the routed experts' too) and in its softmax's float64 sum of each 8
exponentials' sum (attention.py), in its Q8_0_R8 and Q8_1_R8 gemms (qgemm.ORDER_R8_AVX2, ORDER_Q8_1_AVX2: a quantized
K cache's K x Q, -fa off), in its Q8_K_R8 gemm (the IQK types and the i-quants, converted from as many activation rows
as the AVX-512 build converts them from, 32, IQ2_S 16: the AVX-512 build's Q8_K_R16 integers and scales in groups of
8 rows, each 256-value block's signed sum scaled in one fused multiply-add, ORDER_R8_AVX2), in the weight rows a
converted group takes (8, not 16), in its own Q8_0 and IQ4_NL kernel (ORDER_QX_0_AVX2: below 32 activation rows a
thread, and weights of rows no multiple of 8) and in its fused delta-net kernel (8-lane q.k, its scalar update as GCC
contracts it: delta_net.py). ik's flash-attention ports are its AVX2 build's already. Only what was checked bit for
bit against this build runs: other architectures and weight types, and AVX-512-only flags, are refused before any
compute; the integer kernels other than the converted forms', the 32-value block types' own (own_kernel_order) and
those native.py reproduces for this build (the trellis types' own, below their conversion threshold) when a matmul
first needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ikrun.errors import ModelError
from ikrun.numerics.ik.arithmetic import IkNumerics
from ikrun.numerics.ik.formats import UNROUNDED, IkKernel, ToInts, ik_kernel
from ikrun.numerics.ik.native import native_types
from ikrun.numerics.ik.qgemm import (
    ORDER_Q8_1,
    ORDER_Q8_1_AVX2,
    ORDER_QX_0_AVX2,
    ORDER_QX_0_NATIVE,
    ORDER_R8,
    ORDER_R8_AVX2,
    ORDER_R16,
    BlockInts,
    PackedInts,
)

if TYPE_CHECKING:
    import numpy as np

    from ikquant.types import GGMLType

#: the architectures whose ik graph was checked against ik's AVX2 build op for op
VERIFIED_ARCHS = ("qwen3", "deepseek2", "glm-dsa", "openpangu", "qwen3moe", "glm4moe", "minimax-m2", "qwen3next", "qwen35moe")
#: the weight types whose kernels were checked against it
VERIFIED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q6_0", "IQ4_NL", "MXFP4", "IQ4_XS", "Q4_K", "Q5_K",
                  "IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K", "IQ2_KS", "IQ2_KL", "IQ3_KS", "IQ4_KS", "IQ4_KSS",
                  "IQ5_KS", "Q6_K", "IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M",
                  "IQ3_XXS", "IQ3_S", "Q2_K", "Q3_K")
#: the converted weights' gemms of the AVX-512 build (qgemm.ORDER_*) -> the AVX2 build's
AVX2_ORDERS = {ORDER_R8: ORDER_R8_AVX2, ORDER_Q8_1: ORDER_Q8_1_AVX2, ORDER_R16: ORDER_R8_AVX2}
#: the 32-value block types whose own kernel (below the rows ik converts them from) ik's AVX2 build runs on the signed
#: values (qgemm.ORDER_QX_0_AVX2)
AVX2_SIGNED_OWN_KERNELS = ("Q8_0", "IQ4_NL")
#: and those whose own kernel is the AVX-512 build's (the same unpacker and kernel template in both builds)
AVX2_SHARED_OWN_KERNELS = ("Q4_0", "Q5_0", "Q6_0", "MXFP4")


def own_kernel_order(kernel: IkKernel, held: BlockInts) -> BlockInts | None:
    """`held`, a 32-value block type's integers as the AVX-512 build's own kernel takes them (ORDER_QX_0_NATIVE), as
    ik's AVX2 build's own kernel takes them: Q8_0's and IQ4_NL's signed (ORDER_QX_0_AVX2), Q4_0's, Q5_0's, Q6_0's and
    MXFP4's as they are; None for the other types."""
    if any(kernel is ik_kernel(name) for name in AVX2_SIGNED_OWN_KERNELS):
        return replace(held, order=ORDER_QX_0_AVX2, bias=0)
    return held if any(kernel is ik_kernel(name) for name in AVX2_SHARED_OWN_KERNELS) else None


class IkAvx2Numerics(IkNumerics):
    """ik's CPU arithmetic of its AVX2 build (the module docstring)."""

    name = "ik-avx2"
    avx2 = True

    def check_weights(self) -> list[str]:
        arch = self.weights.metadata.architecture
        if arch not in VERIFIED_ARCHS:
            return [f"--numerics ik-avx2 does not reproduce ik's AVX2 arithmetic for {arch} (its ops are not checked "
                    f"against ik's AVX2 build; checked: {', '.join(VERIFIED_ARCHS)}); use --numerics ik"]
        odd = sorted({self.weights.info(name).type.name for name in self.weights.names()
                      if len(self.weights.info(name).ne) >= 2 and name != "token_embd.weight"} - set(VERIFIED_TYPES))
        if odd:
            return [f"--numerics ik-avx2 does not reproduce ik's AVX2 kernels for {', '.join(odd)} weights; checked: "
                    f"{', '.join(VERIFIED_TYPES)}"]
        return super().check_weights()

    def check_type(self, gtype: GGMLType) -> str | None:
        if gtype.name not in VERIFIED_TYPES:
            return (f"--numerics ik-avx2 does not reproduce ik's AVX2 kernels for {gtype.name} weights; checked: "
                    + ", ".join(VERIFIED_TYPES))
        return super().check_type(gtype)

    def _activation_format(self, type_name: str) -> str:
        """ik's AVX2 build multiplies bf16 weights with float32 activations as they are (its float kernel)."""
        return UNROUNDED if type_name == "BF16" else super()._activation_format(type_name)

    def _bf16_kernel(self, type_name: str) -> bool:
        """ik's AVX2 build has no bf16 kernel: bf16 weights and a BF16 key cache go through its float kernel."""
        return False

    def _integers(self, kernel: IkKernel, n_act_rows: int, n_weight_rows: int,
                  threads: int | None = None) -> ToInts | None:
        """The float orders of ik's AVX2 Q8_0_R8, Q8_K_R8 and Q8_1_R8 gemms (qgemm.ORDER_R8_AVX2, ORDER_Q8_1_AVX2)
        and of its own AVX2 Q8_0 kernel (ORDER_QX_0_AVX2: fewer rows); the other integer kernels' AVX2 orders (the
        own kernels of the types it converts) are not reproduced."""
        ints = super()._integers(kernel, n_act_rows, n_weight_rows, threads)
        if ints is None:
            native = any(kernel is ik_kernel(name) for name in native_types())  # native.py has it
            if kernel.convert is not None and not native:  # ik's own integer kernel of a type it converts later
                raise ModelError(f"--numerics ik-avx2 reproduces ik's AVX2 kernels for these weights where it "
                                 f"converts them ({kernel.convert_rows} activation rows and more, {self.row_group} "
                                 f"weight rows a group), not its own kernel, which it takes for {n_act_rows} "
                                 f"activation rows of {n_weight_rows} weight rows")
            return None
        inner = ints

        def avx2(raw, decoded):  # type: ignore[no-untyped-def]
            held = inner(raw, decoded)
            own = own_kernel_order(kernel, held) if held.order == ORDER_QX_0_NATIVE else None
            if own is not None:
                return own
            if held.order not in AVX2_ORDERS:
                raise ModelError(f"--numerics ik-avx2 reproduces ik's AVX2 Q8_0_R8, Q8_K_R8 and Q8_1_R8 kernels (where "
                                 f"it converts these weights) and the own kernels of the 32-value block types, not "
                                 f"the kernel ik takes for {n_act_rows} rows")
            return replace(held, order=AVX2_ORDERS[held.order])

        return avx2

    def _direct(self, kernel: IkKernel, n_act_rows: int, n_weight_rows: int,
                threads: int | None = None) -> Callable[[np.ndarray], PackedInts | None] | None:
        """The Q8_K_R16 integers packed straight from the bytes (q8k_direct.py), in this build's Q8_K_R8 order: the
        same integers, scales and block sums, so only the order changes. The other forms' packings are declined (None:
        `_integers` makes them, or says why it cannot)."""
        direct = super()._direct(kernel, n_act_rows, n_weight_rows, threads)
        if direct is None:
            return None
        inner = direct

        def packed(raw: np.ndarray) -> PackedInts | None:
            held = inner(raw)
            return replace(held, order=ORDER_R8_AVX2) if held is not None and held.order == ORDER_R16 else None

        return packed
