"""Read the benchmark history (docs/benchmarks-history.json).

    python scripts/bench_history.py              # every table row: date, commit, command, row, figures
    python scripts/bench_history.py --runs       # one line per run: date, time, commits, commands, heading
    python scripts/bench_history.py --full       # every run as markdown: its text and tables, as recorded
    python scripts/bench_history.py --full --date YYYY-MM-DD   # only the runs of that date

The file holds every recorded run (date, UTC time, heading, the commits and commands its
text names, then its text and tables in order); docs/benchmarks.md gives the current
figures and says how they were produced. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HISTORY = Path(__file__).resolve().parent.parent / "docs" / "benchmarks-history.json"


def load(path: Path = HISTORY) -> dict:
    """The history file as a dict: ``about``, ``conditions``, ``runs``."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _cell(text: str) -> str:
    return f" {text} " if text else " "


def render_table(table: dict) -> str:
    """A table block as the markdown it was recorded as (the row label first, then its figures)."""
    indent = table.get("indent", "")
    cols = table["columns"]
    lines = ["|" + "|".join(_cell(c) for c in cols) + "|", "|" + "|".join("---" for _ in cols) + "|"]
    for r in table["rows"]:
        cells = [r["row"]] + [r["figures"][c] for c in cols[1:]]
        lines.append("|" + "|".join(_cell(c) for c in cells) + "|")
    return "\n".join(indent + line for line in lines)


def render_run(run: dict) -> str:
    """One run as markdown: its heading, then its text and tables in order."""
    parts = ["## " + run["heading"]]
    for b in run["blocks"]:
        parts.append(b["text"] if "text" in b else render_table(b["table"]))
    return "\n".join(parts)


def render_full(data: dict, runs: list[dict]) -> str:
    """The runs as one markdown document."""
    head = ["# Benchmark history", "", data["about"], "", data["conditions"], ""]
    return "\n".join(head) + "\n".join(render_run(r) for r in runs)


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def rows_table(runs: list[dict]) -> str:
    """Every table row of ``runs`` as one markdown table."""
    out = ["| date | commit | command | row | figures |", "|---|---|---|---|---|"]
    for run in runs:
        for b in run["blocks"]:
            t = b.get("table")
            if t is None:
                continue
            commits = ", ".join(t.get("commits") or run["commits"]) or "-"
            commands = "; ".join(f"`{c}`" for c in (t.get("commands") or run["commands"])) or "-"
            for r in t["rows"]:
                figures = "; ".join(f"{k}: {v}" for k, v in r["figures"].items() if v)
                out.append(f"| {run['date'] or '-'} | {commits} | {_md(commands)} | {_md(r['row'])} | {_md(figures)} |")
    return "\n".join(out)


def runs_table(runs: list[dict]) -> str:
    """One line per run."""
    out = ["| date | UTC | commits | commands | heading |", "|---|---|---|---|---|"]
    for run in runs:
        commands = "; ".join(f"`{c}`" for c in run["commands"]) or "-"
        out.append(f"| {run['date'] or '-'} | {run['time_utc'] or '-'} | {', '.join(run['commits']) or '-'} | "
                   f"{_md(commands)} | {_md(run['heading'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", action="store_true", help="one line per run instead of one per table row")
    ap.add_argument("--full", action="store_true", help="every run as markdown, text and tables")
    ap.add_argument("--date", help="only the runs of this date (YYYY-MM-DD)")
    ap.add_argument("--file", type=Path, default=HISTORY, help="the history file (default: docs/benchmarks-history.json)")
    args = ap.parse_args(argv)
    data = load(args.file)
    runs = [r for r in data["runs"] if args.date is None or r["date"] == args.date]
    if args.full:
        print(render_full(data, runs))
    elif args.runs:
        print(runs_table(runs))
    else:
        print(rows_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
