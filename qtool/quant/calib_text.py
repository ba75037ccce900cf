"""Calibration and evaluation text: a user's file, or the offline default.

The default is English prose that every Python installation carries: the docstrings of a fixed list of
standard-library modules (the module's own, then its public classes, functions and methods, in name order).
Calibration and evaluation read disjoint lists, so a model is never judged on its calibration text. The
text depends only on the Python version (3.11 here), never on a download.

A user's file is read as UTF-8 text, or as JSON lines (`.jsonl`) whose objects carry a "text" string;
records are joined with blank lines.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from qtool.errors import InputError

CALIB_MODULES = ("argparse", "collections", "logging", "pathlib", "subprocess", "threading", "json",
                 "unittest.case", "email.message", "http.client", "urllib.request", "asyncio.events",
                 "concurrent.futures._base", "tarfile", "zipfile", "socket", "functools", "typing")
EVAL_MODULES = ("textwrap", "difflib", "statistics", "fractions", "decimal", "heapq", "bisect", "calendar",
                "csv", "shutil", "string", "random", "datetime", "pprint", "configparser", "gettext")
DEFAULT_CALIB = "the default calibration text (docstrings of Python standard-library modules: " \
                + ", ".join(CALIB_MODULES) + ")"
DEFAULT_EVAL = "the default evaluation text (docstrings of Python standard-library modules: " \
               + ", ".join(EVAL_MODULES) + ")"


def stdlib_docstrings(modules: tuple[str, ...]) -> str:
    """The docstrings of `modules` and their public members, blank-line separated, in a fixed order."""
    parts: list[str] = []
    for name in modules:
        mod = importlib.import_module(name)
        doc = inspect.getdoc(mod)
        if doc:
            parts.append(doc)
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(doc)
                if inspect.isclass(obj):
                    for m in sorted(vars(obj)):
                        f = vars(obj)[m]
                        if not m.startswith("_") and inspect.isfunction(f) and f.__doc__:
                            parts.append(inspect.getdoc(f))
    return "\n\n".join(parts)


def read_text(path: str | Path) -> str:
    """A text or .jsonl file as one string; InputError naming the file and line when it cannot be read."""
    p = Path(path)
    if not p.is_file():
        raise InputError("text file not found", path=p, fix="give an existing UTF-8 text or .jsonl file")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError("text file is not UTF-8", path=p) from None
    if p.suffix.lower() != ".jsonl":
        text = raw
    else:
        texts = []
        for k, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"line {k} is not JSON ({e.msg})", path=p) from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise InputError(f"line {k} has no \"text\" string", path=p,
                                 fix='write one {"text": "..."} object per line')
            texts.append(rec["text"])
        text = "\n\n".join(texts)
    if not text.strip():
        raise InputError("text file holds no text", path=p)
    return text
