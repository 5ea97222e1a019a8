"""The ``autoprec`` command line.

Each subcommand is a thin module in this package: parse the options, call the library, print.
User mistakes (``ValueError``, which autoprec's own errors subclass) become one line on stderr
and exit status 2; a traceback is a bug. Warnings are one line each too (``autoprec: note:``
for the cache's notes, :class:`autoprec.cache.CacheNote`; ``autoprec: warning:`` otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import click

from autoprec import __version__
from autoprec.cli.analyze import analyze
from autoprec.cli.compare import compare
from autoprec.cli.export import export
from autoprec.cli.formats import formats
from autoprec.cli.hardware import hardware
from autoprec.cli.migrate import migrate
from autoprec.cli.models import models
from autoprec.cli.search import search
from autoprec.cli.train import train
from autoprec.cli.verify import verify
from autoprec.defaults import check_compile_environment


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autoprec")
def cli() -> None:
    """autoprec: find the best numeric precision for every layer of a model's training."""


cli.add_command(analyze)
cli.add_command(compare)
cli.add_command(export)
cli.add_command(formats)
cli.add_command(hardware)
cli.add_command(migrate)
cli.add_command(models)
cli.add_command(search)
cli.add_command(train)
cli.add_command(verify)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    # torch.compile's first use on a machine without CUDA logs a "No CUDA runtime" warning
    # that says nothing to an autoprec user
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        check_compile_environment()  # a bad setting is an error before any work
        with _one_line_warnings():
            status = cli.main(args=argv, prog_name="autoprec", standalone_mode=False)
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.ClickException as err:
        err.show()
        return err.exit_code
    except click.exceptions.Abort as err:
        if isinstance(err.__cause__, EOFError):  # click's name for it; no command reads stdin
            click.echo(
                f"autoprec: error: a file ended early ({err.__cause__ or 'EOFError'}); it is "
                "empty or truncated",
                err=True,
            )
            return 1
        click.echo("autoprec: aborted", err=True)
        return 130
    except ValueError as err:
        click.echo(f"autoprec: error: {err}", err=True)
        return 2
    # without standalone mode click returns ctx.exit()'s code (and a command's return value)
    return status if isinstance(status, int) else 0


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Show each warning as one line on stderr (not Python's two, with a source line)."""
    from autoprec.cache import CacheNote

    def show(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
        kind = "note" if issubclass(category, CacheNote) else "warning"
        text = " ".join(str(message).split())
        click.echo(f"autoprec: {kind}: {text}", err=True)

    previous = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous
