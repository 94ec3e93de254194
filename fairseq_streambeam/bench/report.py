"""Benchmark output: a Markdown table shaped like the paper's Table 1, and PNG plots."""

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

COLUMNS = [
    ("method", "method"), ("bleu", "BLEU"), ("chrf", "chrF"), ("seconds_median", "time s (median)"),
    ("seconds_std", "std"), ("ratio_to_baseline", "x baseline"), ("decoder_steps", "steps"),
    ("expansions", "expansions"), ("expansions_per_step", "exp/step"), ("accepted_per_pass", "acc/pass"),
    ("padding_share", "padding"),
    ("peak_mb", "peak MB"), ("sentences_per_second", "sent/s"), ("identical_to_exact_ref", "identical"),
]


PLOTS = ("step_time_vs_length.png", "time_vs_bleu.png")  # write_plots' files


def markdown_table(rows: List[dict]) -> str:
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    sep = "|" + "---|" * len(COLUMNS)
    body = ["| " + " | ".join("" if r.get(k) is None else str(r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_plots(out_dir: Path, rows: List[dict], traces: Dict[str, list]) -> List[Path]:
    """Median model step time against current target length (paper Fig. 2), and time vs BLEU."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)")
        return []

    def save(fig, name: str) -> Path:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        return out_dir / name

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, trace in traces.items():
        by_len = defaultdict(list)
        for length, _rows, seconds in trace:
            by_len[length].append(seconds * 1000)
        xs = sorted(by_len)
        ax.plot(xs, [statistics.median(by_len[x]) for x in xs], label=name)
    ax.set_xlabel("current target length (tokens)")
    ax.set_ylabel("median decoder step time (ms)")
    ax.legend(fontsize=7)
    written = [save(fig, PLOTS[0])]

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["seconds_median"], r["bleu"])
        ax.annotate(r["method"], (r["seconds_median"], r["bleu"]), fontsize=7)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("BLEU")
    return [*written, save(fig, PLOTS[1])]
