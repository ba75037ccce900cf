"""Format modules register themselves on import; `get_format(id)` is the way in.

Each module in this package is one layout (FORMATS.md). Add a new one by writing the module and adding it
to the import list below.
"""

from qtool.formats.base import Format, FormatSpec, all_formats, get_format, register
from qtool.formats.plain import Plain, dequantize

__all__ = ["Format", "FormatSpec", "Plain", "all_formats", "dequantize", "get_format",
           "register"]

# Registration: importing each layout module registers it (kept at the bottom: they import base/plain).
from qtool.formats import (  # noqa: E402,F401
    awq,
    compressed_tensors,
    ct_fp8,
    ct_int8,
    fp8,
    gguf_blocks,
    gptq,
    gptq_planar,
    marlin,
)
