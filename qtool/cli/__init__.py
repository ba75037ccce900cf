"""Thin Typer layer: one module per command. Nothing here imports torch at module load."""
