"""Matplotlib figures for the bench results (PNG next to the JSON they come from)."""
from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path


def optional(plot):
    """``plot`` where matplotlib is installed (the ``bench`` extra); elsewhere a line saying the
    figure was left out, so a run without it still writes its JSON and prints its table."""
    @functools.wraps(plot)
    def run(*args, **kw):
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            print(f"no {plot.__name__} plot: matplotlib is not installed (pip install 'tandem[bench]')")
            return None
        return plot(*args, **kw)
    return run


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


@optional
def attainment_vs_rate(rows: list[dict], path: Path, title: str, key: str = "system") -> None:
    """One line per ``key`` value; left panel TTFT & P99 TBT (Apt-Serve), right TTFT & TPOT (BROS)."""
    plt = _plt()
    curves: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        curves[r.get(key, "FCFS")].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, metric, label in ((axes[0], "attain_apt", "TTFT & P99 TBT"), (axes[1], "attain_bros", "TTFT & TPOT")):
        for name, rs in curves.items():
            rs = sorted(rs, key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rs], [100 * r[metric] for r in rs], marker="o", label=name)
        ax.axhline(90, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("RT request rate (req/s)")
        ax.set_title(f"SLO attainment, {label}")
        ax.set_ylim(0, 101)
    axes[0].set_ylabel("% of RT requests")
    axes[0].legend()
    fig.suptitle(title)
    _save(fig, path)


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.plot([1e3 * x for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label,
                drawstyle="steps-post")


@optional
def latency_cdfs(runs: list[dict], path: Path, title: str) -> None:
    """TTFT and TBT CDFs of RT requests, one line per (system, rate) run.

    ``runs``: dicts with "system", "rate" and "records" (``record_dict`` output).
    """
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        rt = [x for x in run["records"] if x["cls"] == "rt" and x["error"] is None]
        label = f"{run['system']} @ {run['rate']}"
        _cdf(a, [x["ttft"] for x in rt if x["ttft"] is not None], label)
        _cdf(b, [g for x in rt for g in x["gaps"]], label)
    for ax, name in ((a, "TTFT"), (b, "time between tokens")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log)")
        ax.set_ylabel("fraction of RT " + ("requests" if name == "TTFT" else "tokens"))
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle(title)
    _save(fig, path)


@optional
def rt_latency_vs_be_throughput(rows: list[dict], path: Path, title: str) -> None:
    """Each (system, rate) as a point: BE tokens/s against RT normalized latency (the mean, as BROS
    reports it), labelled by rate."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    curves: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        curves[r["system"]].append(r)
    for name, rs in curves.items():
        rs = sorted(rs, key=lambda r: r["rate"])
        xs = [r["be"]["tokens_per_s"] for r in rs]
        ys = [1e3 * r["summary"]["rt"].get("normalized_latency_mean_s", float("nan")) for r in rs]
        ax.plot(xs, ys, marker="o", label=name)
        for x, y, r in zip(xs, ys, rs):
            ax.annotate(f"{r['rate']:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("BE throughput (output tokens/s)")
    ax.set_ylabel("RT normalized latency, mean (ms/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
