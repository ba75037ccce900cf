"""qtool: a toolchain for quantized LLM weights.

Importing the package is cheap: torch and the kernels load only when a command needs them.
"""

__version__ = "0.1.0"
