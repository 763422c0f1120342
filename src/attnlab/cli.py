"""The ``attnlab`` command: a thin layer over the library.

Every subcommand prints a table by default and JSON with ``--json``. User errors (bad presets, configs,
sizes, paths) exit with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import typer

app = typer.Typer(
    name="attnlab",
    help="MHA, MQA, GQA and MLA: what they cost, how fast they decode, and converting checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """MHA, MQA, GQA and MLA: what they cost, how fast they decode, and converting checkpoints."""


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ValueError/TypeError/FileNotFoundError/FileExistsError into one stderr line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, FileNotFoundError, FileExistsError, KeyError) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            print(f"attnlab: error: {message}", file=sys.stderr)
            raise typer.Exit(code=2) from None

    return wrapper


def main() -> None:
    app()
