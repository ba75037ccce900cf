"""The Typer application every command module registers on."""

import typer

app = typer.Typer(
    name="qtool",
    help="Toolchain for quantized LLM weights: pack, repack, inspect, select, bench, validate and eval.",
    no_args_is_help=True,
    add_completion=False,
    # Our own main() turns errors into one line; Typer's rich tracebacks would show internals.
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from qtool import __version__

        typer.echo(f"qtool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", callback=_version,
                                 is_eager=True),
) -> None:
    """Toolchain for quantized LLM weights: pack, repack, inspect, select, bench, validate and eval."""
