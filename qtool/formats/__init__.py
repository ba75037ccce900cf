"""Format modules register themselves on import; `get_format(id)` is the way in.

Each module in this package is one layout (FORMATS.md). Add a new one by writing the module and adding it
to the import list below.
"""

from qtool.formats.base import Format, FormatSpec, LayerParams, all_formats, get_format, register
from qtool.formats.plain import Plain, dequantize

__all__ = ["Format", "FormatSpec", "LayerParams", "Plain", "all_formats", "dequantize", "get_format",
           "register"]

# Registration imports (kept at the bottom: they import base/plain from this package).
import importlib as _importlib

for _mod in ("gptq", "gptq_planar", "awq", "compressed_tensors", "marlin", "gguf_blocks"):
    try:
        _importlib.import_module(f"qtool.formats.{_mod}")
    except ModuleNotFoundError as _e:  # a module not written yet must not break the others
        if _e.name != f"qtool.formats.{_mod}":
            raise
