"""Report dataclasses and their renderings (rich tables, JSON, Markdown). The core returns these; the CLI
renders them."""
