"""GGUF (llama.cpp) Q4_0, Q4_1 and Q8_0 blocks as formats: pure encode/decode between Plain and raw block bytes.

One module's tensor dict is {"weight": uint8 [O, I/32 * block_bytes]}: row o holds the blocks of output row o,
blocks of 32 weights running along the input dimension (GGUF dims are [ne0 = I, ne1 = O]).

    type    bytes         layout                                                     value
    Q4_0    2 + 16        fp16 d | byte j = code j (low nibble), code j+16 (high)     d * (q - 8)
    Q4_1    2 + 2 + 16    fp16 d | fp16 m | same nibbles                             d * q + m
    Q8_0    2 + 32        fp16 d | 32 x int8 x                                       d * x

Plain -> blocks (pack): every block of 32 inputs must lie in one group (G a multiple of 32, G = -1, or an
act-order map that happens to be constant per block) and q - z must fit the block's integer range
(Q4_0: [-8, 7], Q8_0: [-128, 127], Q4_1: b <= 4). Then the codes move exactly; d = s rounded to fp16 and, for
Q4_1, m = -d*z rounded to fp16: that rounding is the only error ("near-exact"), and `assess` reports it.

Blocks -> Plain (unpack): Q4_0 and Q8_0 give symmetric 4-/8-bit G=32 Plains exactly. Q4_1 gives an
asymmetric 4-bit Plain only where -m/d is an integer in [0, 15] in every block; otherwise NotRepresentable
(integer zero points cannot hold a float offset), and a caller must dequantize instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtool.errors import FormatError, NotRepresentable
from qtool.formats.base import Format, FormatSpec, expect, register
from qtool.formats.detection import Detected
from qtool.formats.plain import Plain, dequantize
from qtool.lazy import lazy_module
from qtool.scheme import QuantScheme

torch = lazy_module("torch")

QK = 32
# id -> (bytes per block, ggml type number, GGUF type name)
BLOCKS: dict[str, tuple[int, int, str]] = {
    "gguf_q4_0": (2 + QK // 2, 2, "Q4_0"),
    "gguf_q4_1": (2 + 2 + QK // 2, 3, "Q4_1"),
    "gguf_q8_0": (2 + QK, 8, "Q8_0"),
}
# q - z range each type stores without changing d
_RANGE = {"gguf_q4_0": (-8, 7), "gguf_q8_0": (-128, 127)}
GGUF_IDS = tuple(BLOCKS)


def type_name(fmt_id: str) -> str:
    """The GGUF type name of a block format ("gguf_q4_0" -> "Q4_0")."""
    return BLOCKS[fmt_id][2]


@dataclass(frozen=True)
class Assessment:
    """How exactly a Plain can be stored: kind "exact" | "near-exact" | "impossible"; max_error is
    max |stored value - dequantize(plain)| in float64 (0.0 for exact; None when impossible)."""

    kind: str
    max_error: float | None
    reasons: tuple[str, ...] = ()


# --- byte helpers ------------------------------------------------------------------------------------
def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 [...] -> uint8 [..., 2] little-endian."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _bytes_f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian -> fp16 [...]."""
    return b.contiguous().view(torch.float16).reshape(b.shape[:-1])


def _nibbles_to_bytes(nib: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32] codes < 16 -> uint8 [..., 16]: byte j = code j | code j+16 << 4."""
    return nib[..., : QK // 2] | (nib[..., QK // 2:] << 4)


def _bytes_to_nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] -> uint8 [..., 32] (low nibbles are codes 0..15, high nibbles 16..31)."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def split_blocks(raw: torch.Tensor, fmt_id: str, what: str = "weight") -> torch.Tensor:
    """uint8 [O, nb*bytes] -> uint8 [O, nb, bytes], with a shape error that names the type."""
    nbytes, _, name = BLOCKS[fmt_id]
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise FormatError(f"{name}: '{what}' must be uint8 [O, I/32*{nbytes}], got {raw.dtype} "
                          f"{tuple(raw.shape)}", tensor=what)
    if raw.shape[1] % nbytes:
        raise FormatError(f"{name}: row size {raw.shape[1]} bytes is not a multiple of the {nbytes}-byte block",
                          tensor=what)
    return raw.reshape(raw.shape[0], raw.shape[1] // nbytes, nbytes)


def decode_blocks(raw: torch.Tensor, fmt_id: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Raw rows -> (d fp16 [O, nb], m fp16 [O, nb] or None, values int16 [O, nb, 32]) where the weight is
    d * values (+ m). Values are q - 8 for Q4_0, q for Q4_1, x for Q8_0."""
    blk = split_blocks(raw, fmt_id)
    d = _bytes_f16(blk[..., 0:2])
    if fmt_id == "gguf_q8_0":
        return d, None, blk[..., 2:].contiguous().view(torch.int8).to(torch.int16)
    if fmt_id == "gguf_q4_1":
        m = _bytes_f16(blk[..., 2:4])
        return d, m, _bytes_to_nibbles(blk[..., 4:]).to(torch.int16)
    return d, None, _bytes_to_nibbles(blk[..., 2:]).to(torch.int16) - 8


def dequantize_blocks(raw: torch.Tensor, fmt_id: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Raw rows -> W [O, I] as llama.cpp computes it (fp32 d*v (+ m)), then cast to `dtype` (float32 when None)."""
    d, m, v = decode_blocks(raw, fmt_id)
    w = d.to(torch.float32).unsqueeze(-1) * v.to(torch.float32)
    if m is not None:
        w = w + m.to(torch.float32).unsqueeze(-1)
    return w.reshape(w.shape[0], -1).to(dtype or torch.float32)


def dequantize_any(raw: torch.Tensor, fmt_id: str, tensor: str | None = None, fix: str = "") -> torch.Tensor:
    """float32 W [rows, I] of raw GGUF rows of any type: qtool's block formats, else the gguf package's
    dequantizer; NotRepresentable (naming `tensor`, with `fix`) for a type neither can dequantize."""
    if fmt_id in GGUF_IDS:
        return dequantize_blocks(raw, fmt_id)
    import gguf

    name = fmt_id.removeprefix("gguf:")
    try:
        w = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name])
    except NotImplementedError:
        raise NotRepresentable(f"the gguf package cannot dequantize {name}", tensor=tensor, fix=fix) from None
    return torch.from_numpy(w.copy()).reshape(raw.shape[0], -1)


# --- detection (GGUF headers) ---------------------------------------------------------------------
def detect_gguf(shape: tuple[int, ...], type_name: str, block: tuple[int, int] | None) -> Detected | None:
    """A GGUF weight from its header entry: dims [ne0 = I, ne1 = O, ...]; 1-D tensors (norms, biases) are not
    modules. Every GGML type is described ("gguf:Q4_K"); the three this module converts are named by their
    rows' aliases ("gguf:Q4_0" -> gguf_q4_0). A GGUF file has no safetensors modules, so the classes' `detect`
    answers None."""
    from qtool.io.gguf_reader import ASYM_TYPES, FLOAT_TYPES, nominal_bits

    if len(shape) < 2:
        return None
    i = shape[0]
    o = 1
    for d in shape[1:]:
        o *= d
    # a 3-D tensor (a mixture of experts' stack [E, O, I]) is its E * O rows, and says it is a stack
    experts = o // shape[1] if len(shape) > 2 else None
    if type_name in FLOAT_TYPES:
        return Detected("dense", nominal_bits(type_name), None, None, None, i, o, i * o, detail=type_name,
                        experts=experts)
    group = block[0] if block else None
    # a type id the gguf package does not know says nothing about its blocks: sym and act-order stay unknown
    sym = type_name not in ASYM_TYPES if block else None
    return Detected(f"gguf:{type_name}", nominal_bits(type_name), group, sym, False if block else None, i, o,
                    i * o, detail=type_name, experts=experts)


# --- the formats -----------------------------------------------------------------------------------
class _GGUFBlocks(Format):
    """Shared pack/unpack/assess over one block type; subclasses only set `spec`."""

    @property
    def type_name(self) -> str:
        return BLOCKS[self.spec.id][2]

    # --- Plain -> blocks ---------------------------------------------------------------------------
    def _block_groups(self, plain: Plain) -> tuple[torch.Tensor | None, list[str]]:
        """int64 [nb] group of each 32-input block, or None plus the reasons it has none."""
        i = plain.in_features
        if i % QK:
            return None, [f"{self.type_name} blocks are {QK} inputs; in_features {i} is not a multiple of {QK}"]
        g = plain.group_index().reshape(i // QK, QK)
        if not bool((g == g[:, :1]).all()):
            why = (f"group_size {plain.group_size} is not a multiple of {QK}" if not plain.desc_act
                   else "the act-order group map changes inside a 32-input block")
            return None, [f"{self.type_name} has one scale per {QK} inputs: {why}"]
        return g[:, 0], []

    def _values(self, plain: Plain, bg: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        """int16 [O, nb, 32]: the integer each block stores (q - z, or q for Q4_1), plus range problems."""
        o, i = plain.out_features, plain.in_features
        q = plain.qweight.to(torch.int16).reshape(o, i // QK, QK)
        if self.spec.id == "gguf_q4_1":
            if plain.bits > 4:
                return q, [f"Q4_1 holds 4-bit codes, not {plain.bits}-bit"]
            return q, []
        z = plain.zeros_or_midpoint().to(torch.int16).index_select(1, bg).unsqueeze(-1)
        v = q - z
        lo, hi = _RANGE[self.spec.id]
        bad = int(((v < lo) | (v > hi)).sum())
        if bad:
            return v, [f"{self.type_name} stores d*x with x in [{lo}, {hi}]; {bad} weights have q - z outside it "
                       f"({plain.bits}-bit, {'sym' if plain.sym else 'asym'})"]
        return v, []

    def encode(self, plain: Plain) -> tuple[torch.Tensor | None, list[str]]:
        """(raw block rows uint8 [O, nb*bytes], []) or (None, reasons it cannot be stored)."""
        if plain.bits not in self.spec.bits:
            return None, [f"{self.type_name} holds codes of at most {max(self.spec.bits)} bits, not {plain.bits}"]
        bg, why = self._block_groups(plain)
        if bg is None:
            return None, why
        v, why = self._values(plain, bg)
        if why:
            return None, why
        s = plain.scales.index_select(1, bg)  # [O, nb], source dtype
        d = s.to(torch.float32).to(torch.float16)
        if not bool(torch.isfinite(d).all()) and bool(torch.isfinite(s).all()):
            return None, [f"a scale exceeds the fp16 range of {self.type_name}'s d"]
        parts = [_f16_bytes(d)]
        if self.spec.id == "gguf_q4_1":
            z = plain.zeros_or_midpoint().index_select(1, bg).to(torch.float32)
            # -d*z is exact in fp32 (an 11-bit significand times a 4-bit integer); one rounding to fp16
            m = (-d.to(torch.float32) * z).to(torch.float16)
            if not bool(torch.isfinite(m).all()) and bool(torch.isfinite(d).all()):
                return None, ["m = -d*z exceeds the fp16 range of Q4_1's m"]
            parts.append(_f16_bytes(m))
        if self.spec.id == "gguf_q8_0":
            parts.append(v.to(torch.int8).view(torch.uint8))
        else:
            nib = (v + 8 if self.spec.id == "gguf_q4_0" else v).to(torch.uint8)
            parts.append(_nibbles_to_bytes(nib))
        raw = torch.cat(parts, dim=-1)
        return raw.reshape(plain.out_features, -1).contiguous(), []

    def check(self, plain: Plain) -> list[str]:
        """Reasons the Plain cannot be stored at all without requantization (reads the data)."""
        if plain.bits not in self.spec.bits:
            return [f"{self.type_name} holds codes of at most {max(self.spec.bits)} bits, not {plain.bits}"]
        bg, why = self._block_groups(plain)
        return why if bg is None else self._values(plain, bg)[1]

    def pack(self, plain: Plain) -> dict[str, torch.Tensor]:
        """Plain -> {"weight": uint8 [O, I/32*block_bytes]}; raises NotRepresentable when impossible.
        Rounds d (and Q4_1's m) to fp16; `assess` says how far that moves any weight."""
        raw, why = self.encode(plain)
        if raw is None:
            raise NotRepresentable(f"cannot store as GGUF {self.type_name}: {'; '.join(why)}",
                                   fix="pass --allow-lossy to requantize")
        return {"weight": raw}

    def assess(self, plain: Plain, rows_per_chunk: int = 256) -> Assessment:
        """Exactness of pack(plain): decode what pack writes and compare with dequantize(plain) in float64."""
        raw, why = self.encode(plain)
        if raw is None:
            return Assessment("impossible", None, tuple(why))
        err = 0.0
        for r0 in range(0, plain.out_features, rows_per_chunk):
            rows = slice(r0, r0 + rows_per_chunk)
            part = plain.with_(qweight=plain.qweight[rows], scales=plain.scales[rows],
                               zeros=None if plain.zeros is None else plain.zeros[rows])
            ref = dequantize(part, torch.float64)
            d, m, v = decode_blocks(raw[rows], self.spec.id)
            got = d.to(torch.float64).unsqueeze(-1) * v.to(torch.float64)
            if m is not None:
                got = got + m.to(torch.float64).unsqueeze(-1)
            diff = (got.reshape(ref.shape) - ref).abs()
            if diff.numel():
                err = max(err, float(diff.max()))
        return Assessment("exact" if err == 0.0 else "near-exact", err)

    # --- blocks -> Plain ---------------------------------------------------------------------------
    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme | None = None) -> Plain:
        raw = expect(tensors, "weight", self.type_name)
        d, m, v = decode_blocks(raw, self.spec.id)
        o, nb = d.shape
        meta = {"format": self.spec.id, "gguf_type": self.type_name}
        if self.spec.id == "gguf_q4_0":
            return Plain((v + 8).to(torch.uint8).reshape(o, nb * QK), d, None, None, 4, QK, meta)
        if self.spec.id == "gguf_q8_0":
            return Plain((v + 128).to(torch.uint8).reshape(o, nb * QK), d, None, None, 8, QK, meta)
        z, scales, v, bad = q4_1_zeros(d, m, v)
        if bad:
            raise NotRepresentable(
                f"Q4_1 offset m is not -d*z for an integer z in [0, 15] in {bad} of {o * nb} blocks: an integer "
                "zero point cannot hold it", fix="pass --allow-lossy to requantize")
        return Plain(v.to(torch.uint8).reshape(o, nb * QK), scales, z, None, 4, QK, meta)


def q4_1_zeros(d: torch.Tensor, m: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Integer zero points for Q4_1 blocks: (zeros uint8 [O, nb], scales fp16 [O, nb], codes int16 [O, nb, 32],
    number of blocks with no exact integer zero).

    d*q + m = d*(q - z) needs m = -d*z exactly with z in [0, 15]. A block with d = 0 is the constant m;
    it is stored as scale -m, zero 1, codes 0 (scale * (0 - 1) = m), exact as well.
    """
    d64, m64 = d.to(torch.float64), m.to(torch.float64)
    safe = torch.where(d64 == 0, torch.ones_like(d64), d64)
    z = torch.round(-m64 / safe)
    ok = (d64 != 0) & (z >= 0) & (z <= 15) & (d64 * z == -m64)
    flat = d64 == 0
    scales = torch.where(flat, (-m64).to(torch.float16), d)
    z = torch.where(flat, torch.where(m64 == 0, torch.zeros_like(z), torch.ones_like(z)), z)
    v = torch.where(flat.unsqueeze(-1), torch.zeros_like(v), v)
    bad = int((~(ok | flat)).sum())
    return z.clamp(0, 15).to(torch.uint8), scales, v, bad


@register
class GGUFQ4_0(_GGUFBlocks):
    spec = FormatSpec(id="gguf_q4_0", aliases=("q4_0", "gguf:Q4_0"), bits=(2, 3, 4, 5, 6, 7, 8), tensors=("weight",),
                      required=("weight",),
                      summary="GGUF Q4_0 blocks: fp16 d + 32 nibbles, d*(q-8)", act_order=True)


@register
class GGUFQ4_1(_GGUFBlocks):
    spec = FormatSpec(id="gguf_q4_1", aliases=("q4_1", "gguf:Q4_1"), bits=(2, 3, 4), tensors=("weight",),
                      required=("weight",),
                      summary="GGUF Q4_1 blocks: fp16 d, fp16 m + 32 nibbles, d*q+m", act_order=True)


@register
class GGUFQ8_0(_GGUFBlocks):
    spec = FormatSpec(id="gguf_q8_0", aliases=("q8_0", "gguf:Q8_0"), bits=(2, 3, 4, 5, 6, 7, 8), tensors=("weight",),
                      required=("weight",),
                      summary="GGUF Q8_0 blocks: fp16 d + 32 int8, d*x", act_order=True)
