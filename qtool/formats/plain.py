"""The canonical unpacked form every packed layout is a view of, and the one dequantizer.

Conventions (FORMATS.md, "Canonical form"):
- codes are unsigned, q in [0, 2^bits - 1]; a signed format stores q - 2^(bits-1) and converts at its edge;
- zeros are *true* zeros z in [0, 2^bits - 1]; w = s * (q - z);
- `zeros is None` means symmetric: z = 2^(bits-1) for every group;
- groups run along the input dimension; `g_idx[i]` is the group of input channel i. `g_idx is None` means
  the trivial map i // group_size. Under act-order the map is arbitrary and rows stay in natural order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qtool.errors import FormatError
from qtool.lazy import lazy_module

torch = lazy_module("torch")



class DtypeSet:
    """torch dtypes named without importing torch; `dtype in s` compares by name (torch.float16 ->
    "float16")."""

    def __init__(self, *names: str) -> None:
        self.names = frozenset(names)

    def __contains__(self, dtype: object) -> bool:
        return str(dtype).removeprefix("torch.") in self.names


FLOAT_DTYPES = DtypeSet("float16", "bfloat16", "float32")


@dataclass(frozen=True, eq=False)
class Plain:
    """One quantized linear weight W[out_features, in_features] in canonical form.

    qweight: uint8 [O, I]            one unsigned code per weight (bits <= 8)
    scales:  fp16/bf16/fp32 [O, n_groups]
    zeros:   uint8 [O, n_groups] true zero points, or None for symmetric (z = 2^(bits-1))
    g_idx:   int32 [I] group of each input channel, or None for i // group_size
    bits:    2..8
    group_size: G > 0, or -1 for one group spanning all I
    meta:    free-form facts a format wants to carry through a round trip (e.g. the GPTQ v1 convention
             read); never needed to dequantize.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    group_size: int
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # --- derived facts -------------------------------------------------------------------------
    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def n_groups(self) -> int:
        return int(self.scales.shape[1])

    @property
    def effective_group_size(self) -> int:
        """G with -1 resolved to in_features."""
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def sym(self) -> bool:
        """True when every zero is the midpoint 2^(bits-1) (or zeros were never stored)."""
        if self.zeros is None:
            return True
        return bool((self.zeros == (1 << (self.bits - 1))).all())

    @property
    def desc_act(self) -> bool:
        """True when g_idx is not the trivial i // G map (activation order)."""
        if self.g_idx is None:
            return False
        return not torch.equal(self.g_idx.to(torch.int64), self.trivial_g_idx().to(torch.int64))

    def trivial_g_idx(self) -> torch.Tensor:
        """int32 [I]: i // G."""
        i = torch.arange(self.in_features, dtype=torch.int32, device=self.qweight.device)
        return (i // self.effective_group_size).to(torch.int32)

    def group_index(self) -> torch.Tensor:
        """int64 [I]: the group of each input channel, trivial map materialised."""
        g = self.g_idx if self.g_idx is not None else self.trivial_g_idx()
        return g.to(torch.int64)

    def zeros_or_midpoint(self) -> torch.Tensor:
        """uint8 [O, n_groups]: the zeros, with the symmetric midpoint materialised."""
        if self.zeros is not None:
            return self.zeros
        return torch.full((self.out_features, self.n_groups), 1 << (self.bits - 1), dtype=torch.uint8,
                          device=self.scales.device)

    def with_(self, **changes) -> Plain:
        return replace(self, **changes)

    # --- checks ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise FormatError when the fields contradict each other; cheap (shapes and dtypes only)."""
        b = self.bits
        if not isinstance(b, int) or not 1 <= b <= 8:
            raise FormatError(f"bits={b!r} is outside 1..8", fix="use --bits 2..8")
        if self.qweight.dim() != 2:
            raise FormatError(f"codes must be 2-D [out, in], got shape {tuple(self.qweight.shape)}")
        if self.qweight.dtype != torch.uint8:
            raise FormatError(f"codes must be uint8, got {self.qweight.dtype}")
        o, i = self.qweight.shape
        if self.scales.dtype not in FLOAT_DTYPES:
            raise FormatError(f"scales must be fp16/bf16/fp32, got {self.scales.dtype}")
        if self.scales.dim() != 2 or self.scales.shape[0] != o:
            raise FormatError(f"scales shape {tuple(self.scales.shape)} does not match {o} output rows")
        g = self.group_size
        if g != -1 and g <= 0:
            raise FormatError(f"group_size={g} must be positive or -1")
        if self.g_idx is None:
            expected = 1 if g == -1 else -(-i // g)
            if self.scales.shape[1] != expected:
                raise FormatError(
                    f"scales have {self.scales.shape[1]} groups but in_features {i} with group_size {g} "
                    f"needs {expected}")
        else:
            if self.g_idx.shape != (i,):
                raise FormatError(f"g_idx shape {tuple(self.g_idx.shape)} != ({i},)")
        if self.zeros is not None:
            if self.zeros.shape != self.scales.shape:
                raise FormatError(
                    f"zeros shape {tuple(self.zeros.shape)} != scales shape {tuple(self.scales.shape)}")
            if self.zeros.dtype != torch.uint8:
                raise FormatError(f"zeros must be uint8, got {self.zeros.dtype}")

    @classmethod
    def stand_in(cls, o: int, i: int, bits: int, group: int, sym: bool, g_idx: torch.Tensor | None = None,
                 scale_dtype: torch.dtype | None = None, meta: dict | None = None) -> Plain:
        """A Plain of the given shape and facts whose tensors are zero-stride views (no memory, no data), for
        asking a format's `check` about a module before reading it. Asymmetric zeros are 1: neither the
        midpoint nor the 0 that a v1 target cannot store."""
        ng = 1 if group == -1 else -(-i // group)
        q = torch.zeros((), dtype=torch.uint8).expand(o, i)
        s = torch.ones((), dtype=scale_dtype or torch.float16).expand(o, ng)
        z = None if sym else torch.ones((), dtype=torch.uint8).expand(o, ng)
        return cls(q, s, z, g_idx, bits, group, dict(meta or {}))

    def check_ranges(self) -> list[str]:
        """Data checks (reads every value): codes/zeros in range, g_idx within the groups. [] when fine."""
        problems = []
        top = (1 << self.bits) - 1
        if self.qweight.numel() and _max(self.qweight) > top:
            problems.append(f"a code exceeds {top} for {self.bits}-bit")
        if self.zeros is not None and self.zeros.numel() and _max(self.zeros) > top:
            problems.append(f"a zero point exceeds {top} for {self.bits}-bit")
        if self.g_idx is not None and self.g_idx.numel():
            lo, hi = int(self.g_idx.min()), int(self.g_idx.max())
            if lo < 0 or hi >= self.n_groups:
                problems.append(f"g_idx values span [{lo}, {hi}] but there are {self.n_groups} groups")
        return problems

    def equal(self, other: Plain) -> bool:
        """Exact equality of the represented quantization (symmetric None == explicit midpoints)."""
        return (
            self.bits == other.bits
            and self.qweight.shape == other.qweight.shape
            and torch.equal(self.qweight, other.qweight)
            and self.scales.dtype == other.scales.dtype
            and torch.equal(self.scales, other.scales)
            and torch.equal(self.zeros_or_midpoint(), other.zeros_or_midpoint())
            and torch.equal(self.group_index(), other.group_index())
        )


def _max(t: torch.Tensor) -> int:
    """Max of a tensor; O(1) for a zero-stride (broadcast) view such as a stand-in's."""
    if all(st == 0 for st in t.stride()):
        return int(t[(0,) * t.dim()])
    return int(t.max())


def dequantize(p: Plain, dtype: torch.dtype | None = None, rows: slice | None = None) -> torch.Tensor:
    """W[O, I] = s[:, g] * (q - z[:, g]), computed exactly, then rounded once to `dtype`.

    Default dtype is the scales' dtype: that is what GPTQModel, AutoAWQ and compressed-tensors return.
    For fp16/bf16 scales the product of the scale and an integer below 2^9 is exact in fp32, so fp32 work
    reproduces their bits and also gives the exact float64 value; fp32 scales are multiplied in float64 and
    rounded once. `rows` restricts the work to a slice of output rows (bounded memory on large layers).
    """
    out_dtype = dtype or p.scales.dtype
    work = torch.float64 if p.scales.dtype == torch.float32 else torch.float32
    sl = rows if rows is not None else slice(None)
    q = p.qweight[sl]
    s = p.scales[sl].to(work)
    z = p.zeros_or_midpoint()[sl].to(work)
    if p.g_idx is None and p.in_features % p.effective_group_size == 0:
        # trivial groups: broadcast per group instead of gathering a full [O, I] scale matrix
        o, g = q.shape[0], p.n_groups
        w = (q.to(work).view(o, g, -1) - z.unsqueeze(-1)).mul_(s.unsqueeze(-1)).view(o, -1)
    else:
        gi = p.group_index()
        w = (q.to(work) - z.index_select(1, gi)).mul_(s.index_select(1, gi))
    return w.to(out_dtype)


def relative_error(weight: torch.Tensor, p: Plain, block_rows: int = 512) -> float:
    """‖W − dequantize(p)‖ / ‖W‖ in float64, a block of rows at a time (bounded memory)."""
    num = den = 0.0
    for r in range(0, weight.shape[0], block_rows):
        sl = slice(r, r + block_rows)
        w = weight[sl].to(torch.float64)
        num += float(torch.sum((w - dequantize(p, torch.float64, sl)) ** 2))
        den += float(torch.sum(w * w))
    return (num ** 0.5) / max(den ** 0.5, 1e-300)
