"""Optional C++ helpers under csrc/: built on first use, loaded through ctypes, never required.

Each helper is one .cpp file with a plain C ABI and an `int qtool_<stem>_abi()` symbol. It is built by
torch.utils.cpp_extension into a folder keyed by the source, the flags and the torch version, so a stale
library is never loaded; a library already built is loaded directly, which skips importing cpp_extension
(seconds). Any failure leaves the caller on its torch path, which gives the same bytes; the failure is
recorded for reports. An environment variable per helper chooses: "0" off, "1" on (a build failure is an
error), unset = try it where the caller deems the tensor large enough.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

from qtool.lazy import lazy_module

torch = lazy_module("torch")  # packing loads without torch (qtool/lazy.py)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CFLAGS = ("-O3", "-fopenmp")


class CExtension:
    """csrc/<source>, its ABI version and the environment variable that switches it."""

    def __init__(self, source: str, abi: int, env: str):
        self.path = CSRC / source
        self.name = f"qtool_{self.path.stem}"
        self.abi, self.env = abi, env
        self.reset()

    def reset(self, mode: str | None = None) -> None:
        """mode: "on", "off", or None (the environment variable decides); forgets any earlier attempt."""
        if mode not in (None, "on", "off"):
            raise ValueError(f"mode must be 'on', 'off' or None, not {mode!r}")
        self.override, self.lib, self.tried, self.error = mode, None, False, None

    @property
    def mode(self) -> str:
        return self.override or {"0": "off", "1": "on"}.get(os.environ.get(self.env, ""), "auto")

    def library(self, required: bool = False) -> ctypes.CDLL | None:
        """The loaded library, or None where it is off or cannot be built (RuntimeError instead when it is
        on or `required`)."""
        mode = self.mode
        if mode == "off":
            return None
        if not self.tried:
            self.tried = True
            try:
                self.lib = self._build()
            except Exception as e:  # noqa: BLE001 - the torch path gives the same bytes
                self.error = " ".join(str(e).split())[:200]
        if self.lib is None and self.error and (required or mode == "on"):
            raise RuntimeError(f"cannot build {self.path}: {self.error}")
        return self.lib

    def status(self) -> str:
        """One line for reports: which path runs."""
        if self.lib is not None:
            return f"C++ (csrc/{self.path.name})"
        return f"torch (extension unavailable: {self.error})" if self.error else "torch"

    def _build(self) -> ctypes.CDLL:
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path} not found (installed without csrc/)")
        key = hashlib.sha256(self.path.read_bytes() + repr((CFLAGS, torch.__version__)).encode()).hexdigest()[:16]
        root = Path(os.environ.get("QTOOL_CACHE") or Path.home() / ".cache" / "qtool")
        build = root / "ext" / f"{self.path.stem}-{key}"
        lib = None
        if (build / f"{self.name}.so").is_file():
            try:
                lib = ctypes.CDLL(str(build / f"{self.name}.so"))
            except OSError:
                lib = None  # half-written by a concurrent build: build (cpp_extension locks) and retry
        if lib is None:
            import contextlib
            import io

            from torch.utils import cpp_extension

            build.mkdir(parents=True, exist_ok=True)
            with contextlib.redirect_stdout(io.StringIO()):  # compiler chatter; the core never prints
                path = cpp_extension.load(name=self.name, sources=[str(self.path)], extra_cflags=list(CFLAGS),
                                          extra_ldflags=["-fopenmp"], build_directory=str(build),
                                          is_python_module=False, verbose=False)
            lib = ctypes.CDLL(path)
        abi = getattr(lib, f"{self.name}_abi")
        abi.restype = ctypes.c_int
        if abi() != self.abi:
            raise RuntimeError(f"stale build of {self.path.name} (ABI {abi()} != {self.abi})")
        return lib
