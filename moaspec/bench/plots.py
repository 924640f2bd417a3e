"""PNG plots of a results.json document (matplotlib, imported lazily: the `bench` extra).

- speedup.png: speedup over `none` per category (grouped bars, one colour per method) and the mean;
- tau.png: distribution of per-generation tau (tokens per target forward) per method, box plots
  over all categories and turns.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from moaspec.extras import require_modules

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.figure import Figure

PLOT_FILES = ("speedup.png", "tau.png")


def check_plotting() -> None:
    """Fail before a long run when matplotlib is missing."""
    require_modules("bench", ("matplotlib",), "plotting", " (or pass --no-plots)")


def render_plots(results: dict) -> dict[str, bytes]:
    """-> {file name: PNG bytes}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        return dict(zip(PLOT_FILES, (_speedup(plt, results), _tau(plt, results))))
    finally:
        plt.close("all")


CLIENT_SERVER_PLOT_FILES = ("client_server.png",)
ALL_PLOT_FILES = (*PLOT_FILES, *CLIENT_SERVER_PLOT_FILES)  # what either kind of bench run may write


def render_client_server_plots(results: dict) -> dict[str, bytes]:
    """`bench --client-server`'s figure: per network, each drafter's tokens/s relative to the
    plain server stream (split and server-side) and its time to first token. -> {name: PNG bytes}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["client_server"]
    profiles = list(dict.fromkeys(row["profile"] for row in rows))
    cases = list(dict.fromkeys((row["method"], row["mode"]) for row in rows))
    by_case = {(row["profile"], row["method"], row["mode"]): row for row in rows}
    width = 0.8 / max(1, len(cases))
    try:
        fig, (speed, first) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(profiles) + 4), 4.0))
        for c, (method, mode) in enumerate(cases):
            positions = [i + (c - (len(cases) - 1) / 2) * width for i in range(len(profiles))]
            found = [by_case.get((profile, method, mode)) for profile in profiles]
            label = method if method == "none" else f"{method} ({mode})"
            speed.bar(positions, [row["speedup"] if row else 0.0 for row in found], width, label=label)
            first.bar(positions, [row["time_to_first_token_s"] if row else 0.0 for row in found], width, label=label)
        for ax, ylabel in ((speed, "tokens/s relative to the plain server stream"), (first, "time to first token (s)")):
            ax.set_xticks(range(len(profiles)), profiles)
            ax.set_ylabel(ylabel)
            ax.margins(y=0.25)
        speed.set_ylim(top=max(1.0, *(row["speedup"] for row in rows)) * (1.25 + 0.07 * len(cases)))  # room for the legend
        speed.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        speed.legend(fontsize="small", ncols=2, loc="upper left")
        fig.suptitle(f"moaspec bench --client-server: {results['config']['target']}, {_decoding(results)}")
        return dict(zip(CLIENT_SERVER_PLOT_FILES, (figure_png(plt, fig),)))
    finally:
        plt.close("all")


def _speedup(plt, results: dict) -> bytes:
    categories = [c["category"] for c in results["categories"]] + ["mean"]
    methods = [row["method"] for row in results["summary"]]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(categories) + 2) + 1.8, 4.0))  # + the legend's column
    for m, row in enumerate(results["summary"]):
        values = [row["per_category"][c]["speedup"] for c in categories[:-1]] + [row["speedup"]]
        positions = [i + (m - (len(methods) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(positions, values, width, label=row["method"])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("speedup over none (tokens/s ratio)")
    ax.set_title(f"moaspec bench: {results['config']['target']}, {_decoding(results)}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    return figure_png(plt, fig)


def _tau(plt, results: dict) -> bytes:
    methods = [row["method"] for row in results["summary"]]
    samples = [[run["tau"] for run in results["runs"] if run["method"] == method] or [0.0] for method in methods]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(methods) + 2), 4.0))
    ax.boxplot(samples, showmeans=True)
    ax.set_xticks(range(1, len(methods) + 1), methods)
    ax.set_ylabel("τ per generation (tokens per target forward)")
    ax.set_title(f"τ distribution, {_decoding(results)}")
    return figure_png(plt, fig)


def _decoding(results: dict) -> str:
    temperature = results["config"]["temperature"]
    return "greedy" if temperature == 0 else f"T={temperature}"


def figure_png(plt: ModuleType, fig: Figure) -> bytes:
    """A matplotlib figure, laid out tightly, as PNG bytes (110 dpi); the figure is closed."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
