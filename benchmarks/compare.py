"""Two runs of bench.py side by side: each row's fa_torch and fa_jax times in the second
run's RESULTS.md against the first's, as speed ratios (first ms / second ms: above 1, the
second is faster). The rows are matched by shape and mode; peers, timed in both runs on
the same machine, show how much the machine itself moved.

    python benchmarks/compare.py BASE/RESULTS.md NEW/RESULTS.md
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(__doc__)
    base, new = first_table(argv[0]), first_table(argv[1])
    peers = [c for c in next(iter(new.values())) if c not in KEY_COLUMNS
             and c not in ("fa_torch ms",) and "/" not in c]
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
