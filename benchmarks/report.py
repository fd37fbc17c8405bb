"""Markdown tables and matplotlib plots of the benchmark results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import Report, machine, machine_line


def append_markdown(path: Path, report: Report, command: str) -> None:
    """Append one section: the command, the machine, the date, the ratios against the goals."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "", f"### `{report.scenario}` — {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}", "",
        f"- command: `{command}`", f"- machine: {machine_line(machine())}", "",
    ]
    if report.goals:
        lines += ["| ratio | measured | goal | verdict |", "|---|---|---|---|"]
        for g in report.goals:
            value = "n/a" if g.value is None else f"{g.value:.2f}x"
            verdict = {True: "met", False: "**missed**", None: "not measured"}[g.met]
            note = f" ({g.note})" if g.note else ""
            lines.append(f"| {g.name}{note} | {value} | {g.op} {g.target}x | {verdict} |")
        lines.append("")
    for table in report.results.get("tables", []):
        lines += [*markdown_table(table["columns"], table["rows"]), ""]
    lines += [f"- {n}" for n in report.notes]
    lines += [f"- plot: `{p}`" for p in report.plots]
    with path.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return out


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def plot_memory_timeline(path: Path, timelines: Mapping[str, Mapping[str, object]],
                         budget_mib: float) -> None:
    """One panel per policy: bytes per model stacked over time, with the budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(8, 2.4 * len(timelines)),
                             sharex=True, squeeze=False)
    for ax, (policy, tl) in zip(axes[:, 0], timelines.items(), strict=True):
        t = tl["t"]
        series = tl["models"]
        assert isinstance(series, Mapping)
        ax.stackplot(t, *series.values(), labels=list(series), alpha=0.8)
        ax.axhline(budget_mib, color="black", lw=1.2, label="budget - headroom")
        ax.set_ylabel("MiB")
        ax.set_title(policy, fontsize=9)
    axes[0, 0].legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("seconds into the trace")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def plot_latency_cdfs(path: Path, latencies: Mapping[str, Mapping[str, Sequence[float]]]) -> None:
    """One panel per model type: the latency CDF of each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = sorted({t for by_task in latencies.values() for t in by_task})
    if not tasks:
        return
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 2.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for policy, by_task in latencies.items():
            values = np.sort(np.asarray(by_task.get(task, []), dtype=float))
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=policy)
        ax.set_xscale("log")
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("fraction of requests")
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def plot_loads_over_time(path: Path, loads: Mapping[str, Sequence[float]],
                         duration_s: float) -> None:
    """Loads so far against time, one line per policy: thrash shows as a steep line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    for policy, times in loads.items():
        t = sorted(times)
        ax.step([0.0, *t, duration_s], [0, *range(1, len(t) + 1), len(t)], where="post",
                label=policy)
    ax.set_xlabel("seconds into the trace")
    ax.set_ylabel("loads so far")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
