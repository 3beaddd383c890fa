"""The switches that change what a run computes (`RuntimeOptions`), declared once: the model, the architectures
and the CLI (ikrun/commands/options.py makes every field a flag) read them from here."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ikrun.errors import ModelError
from ikrun.numerics import NUMERICS

#: --mla: "auto" follows ik's llama-perplexity; "prefill" is ik's attn_kv_b path (K and V materialised from the
#: latent cache, build_deepseek2's pp_opt), "decode" the absorbed attn_k_b / attn_v_b path
MLA_PATHS = ("auto", "prefill", "decode")
#: --flash-attn: "auto" is ik's default (on) where the arithmetic reproduces it; "on" / "off" ik's -fa on / off
FLASH_ATTN = ("auto", "on", "off")
#: tokens in a batch from which ik's MLA (mla 2/3 with flash attention, its defaults) takes the attn_kv_b path
MLA_PREFILL_MIN_TOKENS = 128


@dataclass(frozen=True)
class RuntimeOptions:
    """Evaluation switches that change what an architecture computes (the defaults are the model's semantics).

    An architecture lists the ones it honours in its class attribute `runtime_options`; setting any other is an
    error, so a flag never silently does nothing. Each field's metadata holds its command-line help: the CLI makes
    the option --name-with-dashes from it (ikrun/commands/options.py), a bool as a flag, None-defaulted as on/off, an
    int taking a value.
    """

    #: lightning-indexer sparse attention: None keeps the architecture's default (sparse, as the model was trained);
    #: False runs dense attention on every layer (ik without --dsa)
    dsa: bool | None = field(default=None, metadata={"help": (
        "Lightning-indexer sparse attention (glm-dsa): on (the default: the model's semantics) or off (dense attention "
        "on every layer, as ik without --dsa). An error for a model without an indexer.")})
    #: ik's attention-sink boost: the indexer always keeps each sequence's first token (ik's --dsa default)
    dsa_sink: bool = field(default=False, metadata={"help": (
        "Add ik's attention-sink boost to the indexer: each sequence's first token always survives the top-k (ik's "
        "--dsa default, not part of the model). An error for a model without an indexer.")})
    #: reproduce ik's AVX-512 f32 GEMM over-read of openPangu's param-sink values (only fewer than 16 sinks, i.e.
    #: small test models, are affected): the numbers ik prints for them, not the model's
    ik_sink_overread: bool = field(default=False, metadata={"help": (
        "openPangu: reproduce ik's AVX-512 f32 GEMM, which misreads the param-sink values of files with fewer than 16 "
        "sinks (small test models; real ones have 128), to get the numbers ik prints for them. Off: the model's "
        "exact forward.")})

    #: which of ik's two MLA computations runs (MLA_PATHS)
    mla: str = field(default="auto", metadata={"choices": MLA_PATHS, "help": (
        "MLA models (deepseek2, glm-dsa): prefill = ik's prompt-processing path, K and V materialised from the "
        "latent cache through attn_kv_b (what ik's defaults, -fa on -mla 3, run for batches of 128 tokens or more); "
        "decode = the absorbed path through attn_k_b / attn_v_b (single-token generation, and every batch with -fa "
        "off). auto (default): prefill for sequences of 128 tokens or more, as ik's defaults (under --numerics ik "
        "with ik's flash-attention kernels), decode below, with --flash-attn off and for imatrix collection. An "
        "error for a model without MLA.")})
    #: which of ik's attention graphs grouped-query attention runs under ik's arithmetic (FLASH_ATTN)
    flash_attn: str = field(default="auto", metadata={"choices": FLASH_ATTN, "help": (
        "Grouped-query attention (qwen3, qwen3moe, glm4moe, minimax-m2) and DeepSeek's MLA (deepseek2) under "
        "--numerics ik / ik-avx2: on = ik's flash attention (-fa on: its own kernel for head sizes 64, 96, 128, 192, "
        "256, 512, 576/512, ggml's generic one for the others, over its F16 caches; MLA's absorbed form over the "
        "latent cache), off = ik's -fa off graph (K x Q matmul, softmax, V product; MLA in the absorbed form). auto "
        "(default): ik's default, on, where it is reproduced, else off; the report names the graph. The exact "
        "arithmetic computes the same softmax attention either way and refuses the option.")})
    #: the DSA indexer's top-k instead of the file's attention.indexer.top_k (0: the file's)
    dsa_top_k: int = field(default=0, metadata={"help": (
        "The lightning indexer's top-k (ik's -dsatk): the keys each query may see, instead of the file's "
        "attention.indexer.top_k. 0 (default): the file's. An error for a model without an indexer.")})

    #: the arithmetic: "exact" (float32 on exactly decoded weights) or "ik" (ik's CPU backend: activations rounded
    #: to the format each weight type pairs with, ik's f16 KV cache); every architecture honours it
    numerics: str = field(default="exact", metadata={"choices": NUMERICS, "every_arch": True, "help": (
        "exact (default): float32 on the exactly decoded weights, the error of the stored weights alone. ik: the "
        "arithmetic of ik's CPU backend, to get the numbers llama-perplexity prints: activations rounded to the "
        "8-bit (or bf16) format ik pairs with each weight type, and ik's f16 KV cache (whatever --kv-cache says), "
        "in its AVX-512 build's float order. ik-avx2: the same in its AVX2 build's (checked: qwen3, qwen3moe, "
        "qwen3next, qwen35moe, glm4moe, minimax-m2, deepseek2, glm-dsa, openpangu; F32, F16, BF16, Q8_0, Q4_0 "
        "weights, Q4_0 from 32 activation rows a thread; -ctk q8_0, q4_0 and, with --flash-attn off, q6_0, iq4_nl, q5_0, q4_1, q5_1, bf16, q8_KV on "
        "qwen3, qwen3moe, glm4moe, minimax-m2; openPangu's -ctk q8_0 latent).")})

    #: the thread count whose kernel choices --numerics ik reproduces (ik's choice depends on it for matrices of fewer
    #: than 32 rows per thread)
    ik_threads: int = field(default=1, metadata={"every_arch": True, "help": (
        "With --numerics ik: make ik's kernel choices as llama-perplexity makes them with this many threads (-t). "
        "They differ only for matrices of fewer than 32 rows per thread, where ik multiplies with its own kernel "
        "instead of converting the weights first: small test models. Default 1.")})

    #: llama-perplexity's -b whose micro-batches --numerics ik reproduces (0: each chunk a micro-batch of its own)
    ik_batch: int = field(default=0, metadata={"every_arch": True, "help": (
        "With --numerics ik: make ik's kernel choices as llama-perplexity makes them with this -b (its default is "
        "2048): it decodes -b / -c chunks at once, 512 tokens at a time, so chunks shorter than 512 that divide it "
        "share a micro-batch, over whose tokens ik counts a routed expert's (below 32 it multiplies the type's "
        "own kernel, from 32 on converted weights). Default 0: each chunk a micro-batch of its own, as with -b "
        "equal to -c.")})

    def mla_path(self, n_tokens: int) -> str:
        """The MLA path ("prefill" or "decode") a forward of `n_tokens` tokens runs (the --mla help)."""
        if self.mla != "auto":
            return self.mla
        return "prefill" if n_tokens >= MLA_PREFILL_MIN_TOKENS and self.flash_attn != "off" else "decode"

    def given(self) -> list[str]:
        """The options that were set (field names; the command-line flag is --name with dashes)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    def check(self) -> None:
        """Refuse options that contradict each other (which architecture honours which: models.check_options)."""
        if self.numerics not in NUMERICS:
            raise ModelError(f"--numerics {self.numerics!r} is not one of {', '.join(NUMERICS)}")
        if self.ik_threads < 1:
            raise ModelError(f"--ik-threads must be at least 1, not {self.ik_threads}")
        if self.ik_threads != 1 and self.numerics not in ("ik", "ik-avx2"):
            raise ModelError("--ik-threads chooses ik's kernels, which only --numerics ik runs (and ik-avx2)")
        if self.ik_batch < 0 or (self.ik_batch and self.numerics not in ("ik", "ik-avx2")):
            raise ModelError(f"--ik-batch {self.ik_batch}: a token count ik's kernel choices are made for, with "
                             "--numerics ik (or ik-avx2) only")
        if self.ik_sink_overread and self.numerics == "ik-avx2":
            raise ModelError("--ik-sink-overread reproduces ik's AVX-512 build, which --numerics ik-avx2 does not "
                             "compute")
        if self.flash_attn not in FLASH_ATTN:
            raise ModelError(f"--flash-attn {self.flash_attn!r} is not one of {', '.join(FLASH_ATTN)}")
        if self.flash_attn != "auto" and self.numerics not in ("ik", "ik-avx2"):
            raise ModelError("--flash-attn chooses between ik's two attention graphs, which only --numerics ik / "
                             "ik-avx2 compute (the exact arithmetic computes the same softmax attention either way)")
        if self.mla not in MLA_PATHS:
            raise ModelError(f"--mla {self.mla!r} is not one of {', '.join(MLA_PATHS)}")
        if self.mla == "prefill" and self.flash_attn == "off":
            raise ModelError("--mla prefill is ik's flash-attention graph's form; with --flash-attn off (its -fa off "
                             "graph) ik runs the absorbed one, --mla decode")
        if self.dsa_top_k < 0:
            raise ModelError(f"--dsa-top-k must be positive, not {self.dsa_top_k}")
        if self.dsa is False and self.dsa_top_k:
            raise ModelError("--dsa-top-k sets the indexer's top-k, which --dsa off does not run")
        if self.dsa is False and self.dsa_sink:
            raise ModelError("--dsa-sink changes the indexer's top-k selection, which --dsa off does not run")


def every_arch(option: str) -> bool:
    """Whether a RuntimeOptions field applies to every architecture (not listed in their runtime_options)."""
    return any(f.name == option and f.metadata.get("every_arch", False) for f in fields(RuntimeOptions))
