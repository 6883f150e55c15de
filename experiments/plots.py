"""Figures shared by the experiments (matplotlib, Agg backend, PNG)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from osd_jax.serving.report import rolling_mean


def rolling_alpha(curves: dict[str, list[float]], path: str, *, window: int,
                  boundaries: list[tuple[int, str]] = (), title: str = "") -> None:
  """Rolling alpha over requests, one line per run, domain shifts marked."""
  fig, ax = plt.subplots(figsize=(8, 4))
  for label, alphas in curves.items():
    ax.plot(range(1, len(alphas) + 1), rolling_mean(alphas, window), label=label)
  for index, name in boundaries:
    ax.axvline(index, color="grey", ls=":", lw=1)
    ax.text(index, 1.0, f" {name}", va="top", fontsize=8, color="grey")
  ax.set_xlabel("requests served")
  ax.set_ylabel(f"alpha (rolling mean of {window})")
  ax.set_ylim(0, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
