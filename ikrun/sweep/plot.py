"""The sweep as a picture: per type, a heatmap of layers x tensor classes coloured by mean KL-divergence.

matplotlib is an optional extra (`pip install iktools[plot]`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ikrun.errors import MissingExtraError
from ikrun.sweep.measure import SweepRow, layer_of, tensor_class


def plot_sweep(rows: list[SweepRow], path: Path, title: str) -> None:
    """Write `path` (.png or .svg): one heatmap per swept type, log-scaled mean KLD, shared colour scale; cells whose
    effect on perplexity is within noise carry a `~`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib: pip install 'iktools[plot]'") from None
    types = list(dict.fromkeys(r.type for r in rows))
    tensors = sorted({t for r in rows for t in r.tensors})
    layers = sorted({layer for t in tensors if (layer := layer_of(t)) is not None})
    classes = sorted({tensor_class(t) for t in tensors if layer_of(t) is not None})
    values = [r.cost for r in rows if r.cost > 0]
    norm = LogNorm(vmin=min(values), vmax=max(values)) if values else None
    fig, axes = plt.subplots(1, len(types), figsize=(2.2 + 0.45 * len(classes) * len(types), 1.6 + 0.3 * len(layers)),
                             squeeze=False)
    image = None
    for ax, t in zip(axes[0], types):
        grid = np.full((len(layers), len(classes)), np.nan)
        for r in rows:
            if r.type != t:
                continue
            for name in r.tensors:
                layer = layer_of(name)
                if layer is not None:
                    row, col = layers.index(layer), classes.index(tensor_class(name))
                    grid[row, col] = max(r.cost, 1e-12)
                    if r.within_noise:
                        ax.text(col, row, "~", ha="center", va="center", color="white", fontsize=8)
        image = ax.imshow(grid, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
        ax.set_title(t)
        ax.set_xticks(range(len(classes)), classes, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(len(layers)), [str(i) for i in layers], fontsize=8)
        ax.set_ylabel("layer")
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="mean KLD (log)")
    fig.suptitle(title, fontsize=10, y=1.04)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)
