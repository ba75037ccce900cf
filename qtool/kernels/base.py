"""The kernel interface: `forward(x[M, K], layer) -> y[M, N]` over one quantized linear layer.

A layer is a `PackedLayer` (the GPTQ v2 words every integer format converts to exactly) or a `ScaledLayer`
(the float/int8 canonical form `ScaledPlain`: FP8, INT8 W8A8, NVFP4, MX codes in their element type);
`layer_for(plain)` builds the one its canonical form calls for.

A kernel is a class with an id (a stable string), a `check` that says why it cannot run a layer on a
device (empty list = it can), a one-time `prepare` (what an engine does at load time: move tensors, or
convert to the kernel's own runtime layout; never a dense weight for the packed kernels) and `forward`.

    layer = PackedLayer.from_plain(plain).to("cuda")
    k = get_kernel("triton-w4a16")
    state = k.prepare(layer)                 # once
    y = k.forward(x, state)                  # x fp16/bf16 [M, K] -> y [M, N], same dtype

Kernels register with `@register`; `all_kernels()` imports the implementation modules lazily so that
importing this module costs nothing beyond torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from qtool.errors import FormatError, UsageError
from qtool.formats import scaled as _scaled
from qtool.formats.plain import Plain, dequantize
from qtool.formats.scaled import ScaledPlain
from qtool.packing.bitstream import pack_stream, unpack_stream

# Implementation modules, imported on first use of the registry.
KERNEL_MODULES = ("qtool.kernels.torch_ref", "qtool.kernels.torch_int4_cpu", "qtool.kernels.triton",
                  "qtool.kernels.cuda", "qtool.kernels.scaled_mm", "qtool.kernels.cuda_fp8")

ACT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, eq=False)
class PackedLayer:
    """The GPTQ v2 tensors of one linear layer y[M, N] = x[M, K] @ W[N, K]^T (FORMATS.md "GPTQ").

    qweight: int32 [K*bits/32, N]   codes packed along the input rows, little-endian bit stream
    qzeros:  int32 [n_groups, words(N)]  true (v2) zero points packed along the output columns
    scales:  fp16/bf16/fp32 [n_groups, N]
    g_idx:   int32 [K] group of each input row, or None when it is the trivial k // group_size
    bits (2..8), group_size (-1 = one group over all K), in_features K, out_features N

    Codes come in runs of run_length(bits) (32/bits for widths dividing 32, else 32, whose bits words some
    codes straddle): K is a whole number of runs; qzeros holds N zeros padded with zeros to whole runs,
    words(N) = ceil(N / run) * run * bits / 32, so any N (odd ones included) has a layer.
    """

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    out_features: int
    meta: dict = field(default_factory=dict)

    @property
    def K(self) -> int:  # noqa: N802 - the GEMM's name for it
        return self.in_features

    @property
    def N(self) -> int:  # noqa: N802
        return self.out_features

    @property
    def n_groups(self) -> int:
        return int(self.scales.shape[0])

    @property
    def effective_group_size(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def desc_act(self) -> bool:
        return self.g_idx is not None

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes a kernel must stream for the weight: qweight + qzeros + scales (+ g_idx)."""
        n = sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))
        if self.g_idx is not None:
            n += self.g_idx.numel() * self.g_idx.element_size()
        return n

    def to(self, device: str | torch.device) -> PackedLayer:
        mv = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return replace(self, qweight=mv(self.qweight), qzeros=mv(self.qzeros), scales=mv(self.scales),
                       g_idx=mv(self.g_idx))

    def clone(self) -> PackedLayer:
        """A copy in fresh memory (the bench rotates copies so the weight is not served from L2)."""
        cl = (lambda t: None if t is None else t.clone())  # noqa: E731
        return replace(self, qweight=cl(self.qweight), qzeros=cl(self.qzeros), scales=cl(self.scales),
                       g_idx=cl(self.g_idx))

    def group_index(self) -> torch.Tensor:
        """int64 [K] on the layer's device: the group of every input row."""
        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        k = torch.arange(self.in_features, device=self.device, dtype=torch.int64)
        return k // self.effective_group_size

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], bits: int, group_size: int) -> PackedLayer:
        """From a GPTQ v2 tensor dict ("qweight", "qzeros", "scales"[, "g_idx"]); a trivial g_idx is dropped."""
        for name in ("qweight", "qzeros", "scales"):
            if name not in tensors:
                raise FormatError(f"gptq_v2 layer: missing tensor '{name}' (have {sorted(tensors)})", tensor=name)
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise FormatError("gptq_v2 layer: qweight and qzeros must be int32", tensor="qweight")
        if bits not in LAYER_BITS:
            raise FormatError(f"kernels read 2..8-bit GPTQ words, not {bits}-bit", fix="repack to 2..8 bits")
        run = run_length(bits)
        if qweight.shape[0] % (run * bits // 32):
            raise FormatError(f"gptq_v2 layer: qweight has {qweight.shape[0]} rows, not whole runs of {run} "
                              f"{bits}-bit codes ({run * bits // 32} words each)", tensor="qweight")
        k = qweight.shape[0] * 32 // bits
        n = qweight.shape[1]
        if scales.shape[1] != n or qzeros.shape[1] != packed_words(n, bits) or qzeros.shape[0] != scales.shape[0]:
            raise FormatError(f"gptq_v2 layer: shapes disagree: qweight {tuple(qweight.shape)}, qzeros "
                              f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}", tensor="scales")
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            eff = k if group_size == -1 else group_size
            trivial = torch.arange(k, device=g_idx.device, dtype=torch.int64) // eff
            g_idx = None if torch.equal(g_idx.to(torch.int64), trivial) else g_idx.to(torch.int32).contiguous()
        return cls(qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), g_idx, bits, group_size, k, n)

    def to_plain(self) -> Plain:
        """The layer's canonical form on its device: codes uint8 [N, K], scales [N, n_groups], zeros uint8
        [N, n_groups] (the midpoints stored as they are), g_idx."""
        b = self.bits
        codes = unpack_stream(self.qweight, b, self.in_features, dim=0)
        zeros = unpack_stream(self.qzeros, b, self.qzeros.shape[1] * 32 // b, dim=1)[:, : self.out_features]
        return Plain(codes.t().contiguous(), self.scales.t().contiguous(), zeros.t().contiguous(), self.g_idx,
                     b, self.group_size)

    @classmethod
    def from_plain(cls, plain: Plain) -> PackedLayer:
        """Pack a Plain [N, K] of any bits 2..8, on its device (pack_gptq_v2). Where the `gptq_v2` format
        holds the Plain, the bytes are the format's (a test says so); other widths and any N are packed in
        the same bit stream, zeros padded to whole runs."""
        return pack_gptq_v2(plain)


LAYER_BITS = tuple(range(2, 9))


def run_length(bits: int) -> int:
    """Codes per packing run: 32/bits words' worth for widths dividing 32, else 32 codes in `bits` words."""
    return 32 // bits if 32 % bits == 0 else 32


def packed_words(n: int, bits: int) -> int:
    """int32 words holding n codes packed in whole runs (the last one padded)."""
    run = run_length(bits)
    return -(-n // run) * run * bits // 32


def _pad_to_run(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """codes padded with zero codes along `dim` to whole runs."""
    n = codes.shape[dim]
    extra = -(-n // run_length(bits)) * run_length(bits) - n
    if not extra:
        return codes
    shape = list(codes.shape)
    shape[dim] = extra
    return torch.cat([codes, codes.new_zeros(shape)], dim)


def _pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The formats' continuous stream (pack_stream) on the codes' device. Widths dividing 32 pack in place
    on any device (a 70B-sized layer in milliseconds on a GPU); straddling widths expand every code to its
    bits in int64, which would take gigabytes of GPU memory on large layers, so they pack on the CPU."""
    if 32 % bits:
        return pack_stream(codes.cpu(), bits, dim=dim).to(codes.device)
    return pack_stream(codes, bits, dim=dim)


def pack_gptq_v2(plain: Plain) -> PackedLayer:
    """Plain [N, K] on any device -> PackedLayer on that device (bits 2..8; K in whole runs, any N)."""
    b = plain.bits
    if b not in LAYER_BITS:
        raise FormatError(f"kernels read 2..8-bit codes, not {b}-bit")
    run = run_length(b)
    if plain.in_features % run:
        raise FormatError(f"{b}-bit packing: K={plain.in_features} is not a multiple of {run}",
                          fix=f"K must be a multiple of {run} for {b}-bit codes")
    qweight = _pack(plain.qweight.t(), b, dim=0)
    qzeros = _pack(_pad_to_run(plain.zeros_or_midpoint().t(), b, dim=1), b, dim=1)
    g_idx = plain.g_idx.to(torch.int32).contiguous() if plain.desc_act else None
    return PackedLayer(qweight, qzeros, plain.scales.t().contiguous(), g_idx, b, plain.group_size,
                       plain.in_features, plain.out_features)


def unpack_gptq(layer: PackedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """On the layer's device: codes int32 [K, N] and zeros int32 [n_groups, N] (bits 2..8)."""
    plain = layer.to_plain()
    return plain.qweight.t().to(torch.int32).contiguous(), plain.zeros.t().to(torch.int32).contiguous()


def dequantize_packed(layer: PackedLayer, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in `dtype`: the formats' dequantize of the layer's Plain, transposed."""
    return dequantize(layer.to_plain(), dtype).t()


# Bits per code of each ScaledPlain element type (E2M1 codes are 4-bit; the rest are one byte).
ELEMENT_BITS = {"e4m3": 8, "e5m2": 8, "int8": 8, "e2m1": 4}


@dataclass(frozen=True, eq=False)
class ScaledLayer:
    """One linear layer y[M, N] = x[M, K] @ W[N, K]^T in the float/int8 canonical form (formats/scaled.py).

    plain: the ScaledPlain, its tensors on the layer's device: codes [N, K] in the element's storage dtype,
    scales on the (bo, bi) block grid, optional global scale and int8 zeros. Kernels read these tensors as
    they are; nothing is repacked, so the bytes a kernel streams are the checkpoint's.
    """

    plain: ScaledPlain
    meta: dict = field(default_factory=dict)

    @property
    def K(self) -> int:  # noqa: N802
        return self.plain.in_features

    @property
    def N(self) -> int:  # noqa: N802
        return self.plain.out_features

    in_features = K
    out_features = N

    @property
    def element(self) -> str:
        return self.plain.element

    @property
    def bits(self) -> int:
        return ELEMENT_BITS[self.plain.element]

    @property
    def scales(self) -> torch.Tensor:
        return self.plain.scales

    @property
    def strategy(self) -> str:
        return self.plain.strategy

    @property
    def device(self) -> torch.device:
        return self.plain.codes.device

    def _tensors(self) -> list[torch.Tensor]:
        p = self.plain
        return [t for t in (p.codes, p.scales, p.global_scale, p.zeros) if t is not None]

    def nbytes(self) -> int:
        """Bytes a kernel must stream for the weight: codes + scales (+ global scale, zeros)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _map(self, fn) -> ScaledLayer:
        p = self.plain
        opt = (lambda t: None if t is None else fn(t))  # noqa: E731
        return replace(self, plain=p.with_(codes=fn(p.codes), scales=fn(p.scales),
                                           global_scale=opt(p.global_scale), zeros=opt(p.zeros)))

    def to(self, device: str | torch.device) -> ScaledLayer:
        return self._map(lambda t: t.to(device))

    def clone(self) -> ScaledLayer:
        return self._map(lambda t: t.clone())

    def to_plain(self) -> ScaledPlain:
        return self.plain


Layer = PackedLayer | ScaledLayer


def layer_for(plain: Plain | ScaledPlain) -> Layer:
    """The kernel layer of a canonical form: ScaledLayer for a ScaledPlain, the GPTQ v2 words for a Plain."""
    if isinstance(plain, ScaledPlain):
        return ScaledLayer(plain)
    return PackedLayer.from_plain(plain)


def dequantize_canonical(plain: Plain | ScaledPlain, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` by the canonical form's own dequantize (float64: the exact oracle)."""
    if isinstance(plain, ScaledPlain):
        return _scaled.dequantize(plain, dtype)
    return dequantize(plain, dtype)


def dequantize_layer(layer: Layer, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in `dtype` for either kind of layer."""
    if isinstance(layer, ScaledLayer):
        return _scaled.dequantize(layer.plain, dtype).t()
    return dequantize_packed(layer, dtype)


class Kernel:
    """Subclass per kernel; set the class attributes; implement `prepare` and `forward`.

    id:       stable identifier ("torch-ref", "torch-int4-cpu", "triton-w4a16")
    summary:  one line for --help, tables and the README
    devices:  device types it runs on ("cpu", "cuda")
    bits:     code widths it reads in GPTQ v2 words (PackedLayer); () = none
    elements: ScalePlain code element types it reads (ScaledLayer: "e4m3", "int8", "e2m1", ...); () = none
    dtypes:   activation dtypes
    scale_dtypes: scale dtypes it reads (empty: any)
    min_capability: lowest CUDA compute capability it runs on, or None
    err_factor: k in the accuracy contract: the relative error against the dequantize -> float64 oracle may
              be at most k times the same-precision torch baseline's (`qtool validate`, `bench`, the kernel
              tests); `error_factor(dtype)` is what they read, for kernels whose k depends on the dtype
    """

    id: ClassVar[str]
    summary: ClassVar[str]
    devices: ClassVar[tuple[str, ...]]
    bits: ClassVar[tuple[int, ...]]
    elements: ClassVar[tuple[str, ...]] = ()
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    scale_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    min_capability: ClassVar[tuple[int, int] | None] = None
    err_factor: ClassVar[float] = 4.0

    def error_factor(self, dtype: torch.dtype) -> float:
        """k for `dtype` activations (the same for every dtype unless a kernel says otherwise)."""
        return float(self.err_factor)

    def available(self, device: torch.device) -> str | None:
        """Why this kernel cannot run at all on `device` (missing op, library, GPU), or None."""
        if device.type not in self.devices:
            return f"{self.id} runs on {'/'.join(self.devices)}, not {device.type}"
        if device.type == "cuda" and self.min_capability is not None:
            if not torch.cuda.is_available():
                return "torch sees no CUDA device"
            cc = torch.cuda.get_device_capability(device)
            if cc < self.min_capability:
                want = ".".join(map(str, self.min_capability))
                return f"{self.id} needs compute capability >= {want}, device has {cc[0]}.{cc[1]}"
        return None

    def check(self, layer: Layer, dtype: torch.dtype, device: torch.device) -> list[str]:
        """Every reason this kernel refuses `layer` with `dtype` activations on `device`; [] = it runs."""
        why = []
        na = self.available(device)
        if na:
            why.append(na)
        if isinstance(layer, ScaledLayer):
            if layer.element not in self.elements:
                reads = "/".join(self.elements) + " codes" if self.elements else "integer GPTQ v2 words only"
                why.append(f"{self.id} reads {reads}, not {layer.element} codes")
        elif not self.bits:
            why.append(f"{self.id} reads {'/'.join(self.elements)} codes, not {layer.bits}-bit integer GPTQ words")
        elif layer.bits not in self.bits:
            why.append(f"{self.id} reads {'/'.join(map(str, self.bits))}-bit codes, not {layer.bits}-bit")
        if dtype not in self.dtypes:
            names = "/".join(k for k, v in ACT_DTYPES.items() if v in self.dtypes)
            why.append(f"{self.id} takes {names} activations, not {dtype}")
        if self.scale_dtypes and isinstance(layer, PackedLayer) and layer.scales.dtype not in self.scale_dtypes:
            why.append(f"{self.id}: scales dtype {layer.scales.dtype} is not "
                       + "/".join(k for k, v in ACT_DTYPES.items() if v in self.scale_dtypes))
        return why

    def prepare(self, layer: PackedLayer) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def forward(self, x: torch.Tensor, state: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> y [M, N] in x's dtype; `out` (optional, [M, N], x's dtype) receives the result."""
        raise NotImplementedError  # pragma: no cover - interface

    def describe(self, state: Any, m: int) -> str:
        """Which path / launch configuration `forward` takes at batch size m (for bench reports)."""
        return ""


_REGISTRY: dict[str, Kernel] = {}
_LOADED = False


def register(cls: type[Kernel]) -> type[Kernel]:
    """Class decorator: one instance per kernel id."""
    _REGISTRY[cls.id] = cls()
    return cls


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    for mod in KERNEL_MODULES:
        importlib.import_module(mod)
    _LOADED = True


def all_kernels() -> dict[str, Kernel]:
    _load()
    return dict(_REGISTRY)


def get_kernel(name: str) -> Kernel:
    _load()
    if name not in _REGISTRY:
        raise UsageError(f"unknown kernel '{name}'", fix=f"choose one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
