"""The NextN/MTP head (GLM-4.x, DeepSeek-V3's multi-token prediction), as ik's MTP graph (build_mtp_input and
build_glm4_moe_mtp) runs it to draft tokens.

At position p the head takes the target's hidden state of position p - 1 (the output norm's, what ik hands it) and
the embedding of token p: each RMSNormed (`nextn.hnorm`, `nextn.enorm`), concatenated embedding first, projected by
`nextn.eh_proj`; then one decoder layer of the model's own kind under the block's prefix (attention with its own
key/value cache, the layer's FFN or MoE), `nextn.shared_head_norm` and the output projection. Its normed state is
the hidden state the next draft step takes, its logits propose token p + 1.

DeepSeek-V4 carries several hidden streams (hyper-connections): the target hands over its last layer's streams, each
is normed and projected with the same embedding, the layer maps streams to streams, and `collapse` (the head's
hyper-connection mix) makes one state of them before shared_head_norm; the streams are what the next step takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ikrun.context import Context
    from ikrun.models.base import Sequence

#: the decoder layer the head runs (the model's block at the head's index) on one sequence
Layer = Callable[[np.ndarray, "Sequence"], np.ndarray]
#: RMSNorm with the model's epsilon
Norm = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: a multi-stream head's streams [n, streams, n_embd] -> one state [n, n_embd]
Collapse = Callable[[np.ndarray], np.ndarray]

#: the tensors every NextN block carries beside its decoder layer (GLM-4.6 leaves out embed_tokens and
#: shared_head_head, ik then takes the model's own)
REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")


@dataclass(frozen=True)
class NextnHead:
    """One NextN block `blk.{block}.` of a model (the module docstring)."""

    block: int
    embeddings: str  # the token embedding table the head reads
    output: str  # the output projection it ends with
    layer: Layer
    norm: Norm
    streams: int = 1  # hidden streams per position (DeepSeek-V4's hyper-connections)
    collapse: Collapse | None = None  # how several streams become one state (None: one stream)

    @staticmethod
    def missing(cx: Context, block: int) -> list[str]:
        """The NextN tensors block `block` lacks (all of them for a file without a NextN layer)."""
        return [f"blk.{block}.{n}" for n in REQUIRED if not cx.has(f"blk.{block}.{n}")]

    @classmethod
    def of(cls, cx: Context, block: int, output: str, layer: Layer, norm: Norm, own_tables: bool = True,
           streams: int = 1, collapse: Collapse | None = None) -> NextnHead:
        """The head of block `block`, with the model's embeddings and `output` where it carries none of its own (or,
        not `own_tables`, always: what ik runs where its loader ignores the head's own)."""
        b = f"blk.{block}.nextn."
        own_embd, own_head = b + "embed_tokens.weight", b + "shared_head_head.weight"
        return cls(block, own_embd if own_tables and cx.has(own_embd) else "token_embd.weight",
                   own_head if own_tables and cx.has(own_head) else output, layer, norm, streams, collapse)

    def __call__(self, cx: Context, hidden: np.ndarray, seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """The head's states [n, streams x n_embd] (one stream: normed) and logits [n, vocab] at the positions of
        `seq` (its tokens), from the target's hidden rows of the positions before them."""
        b, n, c = f"blk.{self.block}.nextn.", len(seq), self.streams
        cx.chunk = seq.index  # observers are told which chunk they see
        e = self.norm(cx.embed_rows(self.embeddings, seq.tokens), cx.weight(b + "enorm.weight"))
        h = self.norm(hidden.reshape(n * c, -1), cx.weight(b + "hnorm.weight"))
        e = np.repeat(e, c, axis=0) if c > 1 else e
        x = cx.linear(np.ascontiguousarray(np.concatenate([e, h], axis=1), dtype=np.float32), b + "eh_proj")
        y = self.layer(x.reshape(n, c, -1) if c > 1 else x, seq)
        if self.collapse is None:
            state = x = self.norm(y, cx.weight(b + "shared_head_norm.weight"))
        else:
            state, x = y.reshape(n, -1), self.norm(self.collapse(y), cx.weight(b + "shared_head_norm.weight"))
        return state, np.ascontiguousarray(cx.project(x, self.output), dtype=np.float32)
