"""Where qtool's data files live (kernel declarations, device profiles, model shapes, example jobs), and the
limits every path a user gives must fit."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"

NAME_MAX = 255    # bytes per path component (Linux NAME_MAX on every common filesystem)
PATH_MAX = 4096   # bytes of the whole path (Linux PATH_MAX, NUL included)


def check_path_length(path: str | Path, what: str) -> None:
    """Refuse a path the system cannot open (a component over 255 bytes, or over 4095 bytes in all) with
    one line, before any work, instead of an ENAMETOOLONG from deep inside a run."""
    from qtool.errors import UsageError

    raw = os.fsencode(path)
    shown = os.fsdecode(raw[:60]) + "..."
    if len(raw) >= PATH_MAX:
        raise UsageError(f"{what} path is {len(raw)} bytes long; the limit is {PATH_MAX - 1}", path=shown,
                         fix="use a shorter path")
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise UsageError(f"{what} has a name of {len(longest)} bytes ('{os.fsdecode(longest[:40])}...'); the "
                         f"limit is {NAME_MAX} per name", path=shown, fix="use a shorter name")
