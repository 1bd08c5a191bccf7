"""Terminal output of the CLI's long runs: a status line or a progress bar on stderr
(none with ``--json``), and result tables (rich)."""

from __future__ import annotations

from typing import Callable

__all__ = ["console", "print_table", "run_with_bar", "run_with_status"]


def console():
    """A rich console on stderr."""
    from rich.console import Console

    return Console(stderr=True)


def run_with_status(title: str, fn: Callable[[Callable[[str], None]], dict], quiet: bool) -> dict:
    """Run ``fn(progress)`` under a live status line on stderr (none with --json)."""
    if quiet:
        return fn(lambda _m: None)
    with console().status(title) as status:
        return fn(lambda m: status.update(f"{title}: {m}"))


def run_with_bar(title: str, fn: Callable[[Callable[[str], None]], dict], quiet: bool, total: int) -> dict:
    """Run ``fn(progress)`` under a rich progress bar on stderr (none with --json): each
    ``progress(message)`` call starts the next of ``total`` steps."""
    if quiet:
        return fn(lambda _m: None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[step]}"), console=console()) as bar:
        task = bar.add_task(title, total=total, step="")
        calls = [0]

        def say(msg: str) -> None:
            bar.update(task, completed=min(calls[0], total), step=msg)
            calls[0] += 1

        res = fn(say)
        bar.update(task, completed=total, step="done")
    return res


def print_table(title: str, result: dict, keys: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in keys:
        if k in result:
            v = result[k]
            table.add_row(k, f"{v:,}" if isinstance(v, int) else f"{v:.4g}" if isinstance(v, float) else str(v))
    Console().print(table)
