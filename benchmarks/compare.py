"""Two runs of bench.py side by side: each row's fa_torch and fa_jax times in the second
run's RESULTS.md against the first's, as speed ratios (first ms / second ms: above 1, the
second is faster). The rows are matched by shape and mode; peers, timed in both runs on
the same machine, show how much the machine itself moved.

    python benchmarks/compare.py BASE/RESULTS.md NEW/RESULTS.md

With ``--versions``, one table of runs made under different stacks (each labelled, e.g.
by its Triton version) on the same machine: each TFLOP/s cell holds every run's figure,
in the order given, and each of ours is divided by its own framework's cuDNN of the
same run.

    python benchmarks/compare.py --versions "triton 3.6=A/RESULTS.md" "triton 3.9=B/RESULTS.md" \
        [--plot bench.png]
"""
from __future__ import annotations

import sys

KEY_COLUMNS = ("B", "Sq", "Sk", "Hq", "Hk", "D", "causal", "mode")


def first_table(path: str) -> dict:
    """The main table of a bench.py RESULTS.md: {row key: {column: cell}}."""
    rows, header = {}, None
    with open(path) as fh:
        for line in fh:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                if line.startswith("| B |") and "fa_torch ms" in line:
                    header = cells
                continue
            if not line.startswith("|"):
                break
            if set(line.strip()) <= set("|-"):
                continue
            row = dict(zip(header, cells))
            rows[tuple(row[c] for c in KEY_COLUMNS)] = row
    if header is None:
        raise SystemExit(f"{path}: no bench.py table (a line starting '| B |' with 'fa_torch ms')")
    return rows


def ratio(base: str, new: str) -> str:
    """new / base of two TFLOP/s cells ("—" where either run has none)."""
    try:
        a, b = float(base), float(new)
    except ValueError:
        return "—"
    return f"{b / a:.3f}"


def tflops_columns(table: dict) -> list:
    """The TFLOP/s columns of a ``first_table``: ours and every peer, not the ratios."""
    return [c for c in next(iter(table.values())) if c not in KEY_COLUMNS
            and c not in ("fa_torch ms",) and "/" not in c]


def labelled_runs(labelled: list[str]) -> tuple:
    """(labels, tables, the first table's TFLOP/s columns) of ``label=path`` arguments."""
    labels, runs = zip(*(item.split("=", 1) for item in labelled))
    tables = [first_table(path) for path in runs]
    return labels, tables, tflops_columns(tables[0])


def versions_table(labelled: list[str]) -> str:
    """One markdown table of several bench.py runs (``label=path`` each), matched by row."""
    labels, tables, columns = labelled_runs(labelled)
    # each of ours against the cuDNN of its own framework, in the same run
    cudnn = {c: "jax cuDNN" if c.startswith("fa_jax") else "torch SDPA cuDNN"
             for c in columns if c.startswith(("fa_torch", "fa_jax"))}
    cudnn = {c: peer for c, peer in cudnn.items() if peer in columns}
    lines = [f"TFLOP/s, each cell {' / '.join(labels)}.\n",
             "| " + " | ".join(KEY_COLUMNS) + " | " + " | ".join(columns) + " | "
             + " | ".join(f"{c} / {peer}" for c, peer in cudnn.items()) + " |"]
    lines.append("|" + "---|" * (lines[-1].count("|") - 1))
    for key in tables[0]:
        rows = [table.get(key, {}) for table in tables]
        cells = [" / ".join(row.get(c, "—") for row in rows) for c in columns]
        cells += [" / ".join(ratio(row.get(peer, "—"), row.get(c, "—")) for row in rows)
                  for c, peer in cudnn.items()]
        lines.append("| " + " | ".join(key) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def versions_plot(labelled: list[str], path: str) -> None:
    """One bar group a row of ``versions_table``: each TFLOP/s column of each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, tables, columns = labelled_runs(labelled)
    bars = [(c, label, table) for c in columns for label, table in zip(labels, tables)
            if c.startswith(("fa_torch", "fa_jax")) or label == labels[-1]]
    keys = list(tables[0])
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(keys)), 4))
    for i, (column, label, table) in enumerate(bars):
        heights = [float(table.get(key, {}).get(column, "nan").replace("—", "nan"))
                   for key in keys]
        name = column if not column.startswith(("fa_torch", "fa_jax")) else f"{column}, {label}"
        ax.bar([x + i * width for x in range(len(keys))], heights, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))])
    ax.set_xticklabels([f"H{k[3]}/{k[4]} D{k[5]}{' causal' if k[6] == 'True' else ''}\n{k[7]}"
                        for k in keys], fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--versions"] and len(argv) >= 3:
        plot = None
        if "--plot" in argv:
            at = argv.index("--plot")
            plot, argv = argv[at + 1], argv[:at] + argv[at + 2:]
        print(versions_table(argv[1:]), end="")
        if plot:
            versions_plot(argv[1:], plot)
        return 0
    if len(argv) != 2:
        raise SystemExit(__doc__)
    base, new = first_table(argv[0]), first_table(argv[1])
    peers = tflops_columns(new)
    print(f"{argv[1]} against {argv[0]}: fa_torch's ms in each, then each TFLOP/s column's "
          "ratio, new over base (> 1: the new run is faster)\n")
    print("| " + " | ".join(KEY_COLUMNS) + " | fa_torch ms, base | fa_torch ms, new | "
          + " | ".join(peers) + " |")
    print("|" + "---|" * (len(KEY_COLUMNS) + 2 + len(peers)))
    for key, row in new.items():
        if key not in base:
            continue
        old = base[key]
        cells = [old["fa_torch ms"], row["fa_torch ms"]]
        cells += [ratio(old.get(p, "—"), row[p]) for p in peers]
        print("| " + " | ".join(key) + " | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
