"""OCP microscaling (MX v1.0): E2M1 or E4M3 codes, one E8M0 (power of two) scale per 32 inputs.

W = code * 2^(scale_byte - 127); scale byte 0xFF is NaN (OCP MX v1.0 section 5.4). No global scale, no zero
point. The product of a code and a power of two is exact in fp32 (and in bf16 for E2M1, whose values carry
two significant bits), so forming it in fp32 and rounding once to the model dtype gives what
compressed-tensors' bf16 decompress gives: ScaledPlain compute "float32".

`mxfp4` (compressed-tensors `mxfp4-pack-quantized`):
    weight_packed   uint8 [O, I/2]     two E2M1 codes per byte, element 2i in the low nibble
    weight_scale    uint8 [O, I/32]    E8M0 bytes
`mxfp8` (compressed-tensors `mxfp8-quantized`):
    weight          float8_e4m3fn [O, I]
    weight_scale    uint8 [O, I/32]    E8M0 bytes
`gptoss_mxfp4` (gpt-oss; transformers' `Mxfp4Config`, `quant_method: mxfp4`):
    <name>_blocks   uint8 [..., O, I/32, 16]   the 32 codes of each block, two per byte, low nibble first
    <name>_scales   uint8 [..., O, I/32]       E8M0 bytes
  gpt-oss stores its MoE experts this way as 3-D tensors (`mlp.experts.gate_up_proj_blocks` [E, O, I/32, 16]);
  those are decoded by `decode_blocks` (inspect) but not converted: qtool's canonical form is one 2-D linear
  weight, and an expert stack is E of them under one name. A 2-D linear is read and written as
  `weight_blocks` / `weight_scales`.
"""

from __future__ import annotations

from qtool.errors import FormatError
from qtool.formats.base import FormatSpec, expect, format_id, register
from qtool.formats.detection import Claims, Detected
from qtool.formats.scaled import ScaledPlain
from qtool.formats.scaled_format import ScaledFormat
from qtool.lazy import lazy_module
from qtool.packing.minifloat import e2m1_decode, e8m0_decode, pack_nibbles, unpack_nibbles
from qtool.scheme import QuantScheme

torch = lazy_module("torch")

GROUP = 32
DEFAULT_OUT = "bfloat16"


def _out_dtype(params: QuantScheme | None) -> str:
    d = (params.extra or {}).get("dtype") if params is not None else None
    return d if d in ("bfloat16", "float16", "float32") else DEFAULT_OUT


def _scales(t: dict, name: str, fid: str, o: int, i: int) -> torch.Tensor:
    s = expect(t, name, fid)
    if s.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        raise FormatError(f"{fid}: '{name}' must hold E8M0 bytes (uint8), got {s.dtype}", tensor=name)
    s = s.view(torch.uint8)
    if tuple(s.shape) != (o, i // GROUP):
        raise FormatError(f"{fid}: '{name}' {tuple(s.shape)} does not cover [{o}, {i}] in blocks of {GROUP} "
                          f"(want ({o}, {i // GROUP}))", tensor=name, fix="the file is not MX or is truncated")
    return s


_E8M0_SIGS = ("U8", "F8_E8M0")


class _Mx(ScaledFormat):
    element: str
    strategies = ("group",)
    scale_types = ("e8m0",)
    compute = "fp32"
    default_block = (1, GROUP)

    def _detect(self, wname: str, t, claims: Claims, i_per: int) -> Detected:
        """MX facts of a module whose code tensor `wname` holds i_per inputs per element of its last dim."""
        fid = self.spec.id
        _wdt, ws = t[wname]
        sdt, ss = t["weight_scale"]
        notes: list[tuple[str, str]] = []
        if len(ws) != 2:
            return Detected("unknown", notes=[("error", f"{fid}: '{wname}' {list(ws)} is not 2-D")])
        o, i = ws[0], ws[1] * i_per
        group = None
        if len(ss) == 2 and ss[0] == o and ss[1]:
            group = -(-i // ss[1])
            if ss[1] * GROUP != i:
                notes.append(("error", f"{fid}: weight_scale {list(ss)} does not hold one E8M0 scale per {GROUP} "
                                       f"of {i} inputs"))
        else:
            notes.append(("error", f"{fid}: weight_scale {list(ss)} does not match [{o}, {i // GROUP}]"))
        claimed = format_id(claims.format) if claims.format else None
        if claimed not in (None, fid):
            notes.append(("error", f"config says {claims.format} but the tensors are {fid} ({wname} + E8M0 "
                                   f"weight_scale {sdt} per {GROUP})"))
        bits = 4 if self.element == "e2m1" else 8
        if claims.bits not in (None, bits):
            notes.append(("error", f"config says {claims.bits}-bit but {fid} codes are {bits}-bit"))
        return Detected(fid, bits, group, True, False, i, o, i * o,
                        detail=f"OCP MX ({self.element.upper()}, E8M0 scale per {GROUP})", notes=notes)

    def check(self, plain) -> list[str]:
        fid = self.spec.id
        if not isinstance(plain, ScaledPlain):
            return [] if plain.in_features % GROUP == 0 else [
                f"{fid} needs in_features to be a multiple of {GROUP}, not {plain.in_features}"]
        why = []
        if plain.element != self.element:
            why.append(f"{fid} stores {self.element} codes, not {plain.element}")
        if plain.scale_type != "e8m0" or plain.block != (1, GROUP):
            why.append(f"{fid} stores e8m0 scales per (1, {GROUP}), not {plain.scale_type} per {plain.block}")
        if plain.zeros is not None:
            why.append(f"{fid} is symmetric: no zero points")
        if plain.global_scale is not None:
            why.append(f"{fid} has no global scale")
        if plain.in_features % GROUP:
            why.append(f"{fid} needs in_features to be a multiple of {GROUP}, not {plain.in_features}")
        return why

    def adapt(self, plain: ScaledPlain) -> tuple[ScaledPlain | None, list[str]]:
        """(plain, []) when this layout stores it exactly, else (None, why). The compute dtype may change
        freely: a code times a power of two is exact in fp32 and in the model dtype alike."""
        why = self.check(plain)
        return (None, why) if why else (plain.with_(compute="float32"), [])

    def _plain(self, codes: torch.Tensor, scales: torch.Tensor, params: QuantScheme | None) -> ScaledPlain:
        return ScaledPlain(codes, self.element, scales, "e8m0", (1, GROUP), "float32", _out_dtype(params),
                           meta={"format": self.spec.id})

    @staticmethod
    def _ct_config(names: list[str], bits: int, fmt: str, dense: list[str] | None) -> dict:
        weights = {"num_bits": bits, "type": "float", "symmetric": True, "group_size": GROUP, "strategy": "group",
                   "dynamic": False, "observer": "minmax", "observer_kwargs": {}, "block_structure": None,
                   "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}
        return {"quant_method": "compressed-tensors", "format": fmt, "version": "0.20.0",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": names, "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": fmt}},
                "ignore": list(dense or []), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
                "global_compression_ratio": None}


@register
class CtMxfp4(_Mx):
    spec = FormatSpec(
        id="mxfp4",
        aliases=("ct_mxfp4", "mxfp4-pack-quantized"),
        bits=(4,),
        tensors=("weight_packed", "weight_scale"),
        required=("weight_packed", "weight_scale"),
        summary="compressed-tensors mxfp4-pack-quantized: E2M1 pairs U8 [O, I/2], E8M0 scale U8 per 32",
        group_sizes=(GROUP,),
        asym=False,
    )
    element = "e2m1"
    elements = ("e2m1",)

    def detect(self, module: str, t, claims: Claims) -> Detected | None:
        wp, sc = t.get("weight_packed"), t.get("weight_scale")
        if wp is None or wp[0] != "U8" or sc is None or sc[0] not in _E8M0_SIGS or "weight_global_scale" in t:
            return None
        return self._detect("weight_packed", t, claims, 2)

    def pack(self, plain: ScaledPlain) -> dict[str, torch.Tensor]:
        p = self.require(plain)
        return {"weight_packed": pack_nibbles(p.codes).contiguous(), "weight_scale": p.scales.contiguous()}

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme | None = None) -> ScaledPlain:
        fid = self.spec.id
        packed = expect(tensors, "weight_packed", fid, dtype=torch.uint8, dims=2)
        o, i = packed.shape[0], packed.shape[1] * 2
        return self._plain(unpack_nibbles(packed), _scales(tensors, "weight_scale", fid, o, i), params)

    def quantization_config(self, modules, dense: list[str] | None = None) -> dict:
        return self._ct_config([n for n, _s, _m in modules], 4, "mxfp4-pack-quantized", dense)


@register
class CtMxfp8(_Mx):
    spec = FormatSpec(
        id="mxfp8",
        aliases=("ct_mxfp8", "mxfp8-quantized"),
        bits=(8,),
        tensors=("weight", "weight_scale"),
        required=("weight", "weight_scale"),
        summary="compressed-tensors mxfp8-quantized: E4M3 weight [O, I], E8M0 scale U8 per 32",
        group_sizes=(GROUP,),
        asym=False,
    )
    element = "e4m3"
    elements = ("e4m3",)

    def detect(self, module: str, t, claims: Claims) -> Detected | None:
        """An E4M3 weight whose weight_scale is E8M0 bytes: read as linear values (FP8's rule) every scale
        would be off by 2^(127 - byte) and positive-only garbage."""
        w, sc = t.get("weight"), t.get("weight_scale")
        if w is None or w[0] != "F8_E4M3" or sc is None or sc[0] not in _E8M0_SIGS:
            return None
        return self._detect("weight", t, claims, 1)

    def pack(self, plain: ScaledPlain) -> dict[str, torch.Tensor]:
        p = self.require(plain)
        return {"weight": p.codes.contiguous(), "weight_scale": p.scales.contiguous()}

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme | None = None) -> ScaledPlain:
        fid = self.spec.id
        w = expect(tensors, "weight", fid, dtype=torch.float8_e4m3fn, dims=2)
        o, i = w.shape
        return self._plain(w, _scales(tensors, "weight_scale", fid, o, i), params)

    def quantization_config(self, modules, dense: list[str] | None = None) -> dict:
        return self._ct_config([n for n, _s, _m in modules], 8, "mxfp8-quantized", dense)


@register
class GptOssMxfp4(_Mx):
    spec = FormatSpec(
        id="gptoss_mxfp4",
        aliases=("gpt-oss", "gpt_oss_mxfp4"),
        bits=(4,),
        tensors=("weight_blocks", "weight_scales"),
        required=("weight_blocks", "weight_scales"),
        summary="gpt-oss MXFP4: <name>_blocks U8 [O, I/32, 16] (E2M1 pairs), <name>_scales U8 [O, I/32] E8M0",
        group_sizes=(GROUP,),
        asym=False,
    )
    element = "e2m1"
    elements = ("e2m1",)

    def detect(self, module: str, t, claims: Claims) -> Detected | None:
        """Every `<name>_blocks` U8 [..., G, 16] paired with `<name>_scales` U8 [..., G] (gpt-oss names its
        expert projections `gate_up_proj` / `down_proj` under one `experts` module; `<name>_bias` may sit
        beside them)."""
        names = sorted(k[: -len("_blocks")] for k in t if k.endswith("_blocks"))
        if not names:
            return None
        notes: list[tuple[str, str]] = []
        total, parts, first = 0, [], None
        for n in names:
            bdt, bs = t[f"{n}_blocks"]
            sc = t.get(f"{n}_scales")
            if bdt != "U8" or len(bs) < 3 or bs[-1] != GROUP // 2:
                return None
            if sc is None or sc[0] not in _E8M0_SIGS or tuple(sc[1]) != tuple(bs[:-1]):
                notes.append(("error", f"gpt-oss {n}_blocks {list(bs)} without a matching {n}_scales "
                                       f"{list(bs[:-1])} (E8M0 U8)"))
                continue
            lead, o, i = bs[:-3], bs[-3], bs[-2] * GROUP
            e = 1
            for d in lead:
                e *= d
            total += e * o * i
            parts.append(f"{n} {'x'.join(map(str, lead)) + ' experts of ' if lead else ''}[{o}, {i}]")
            first = first or (o, i, e if lead else None)
        if claims.quant_method not in (None, "mxfp4"):
            notes.append(("error", f"config says {claims.quant_method} but the tensors are gpt-oss MXFP4 "
                                   "(_blocks / _scales)"))
        if any(len(t[f"{n}_blocks"][1]) > 3 for n in names):
            notes.append(("info", "3-D MoE expert stacks: inspect decodes them; pack/repack convert 2-D linear "
                                  "weights only"))
        o, i, experts = first or (None, None, None)
        if experts:  # a stack is its E * O rows, and says it is one (select plans no linear layer of it)
            o *= experts
        return Detected(self.spec.id, 4, GROUP, True, False, i, o, total or None,
                        detail="gpt-oss MXFP4: " + "; ".join(parts), notes=notes, experts=experts)

    def pack(self, plain: ScaledPlain) -> dict[str, torch.Tensor]:
        p = self.require(plain)
        o, i = p.codes.shape
        return {"weight_blocks": pack_nibbles(p.codes).reshape(o, i // GROUP, GROUP // 2).contiguous(),
                "weight_scales": p.scales.contiguous()}

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme | None = None) -> ScaledPlain:
        fid = self.spec.id
        blocks = expect(tensors, "weight_blocks", fid, dtype=torch.uint8)
        if blocks.dim() != 3 or blocks.shape[-1] != GROUP // 2:
            raise FormatError(f"{fid}: 'weight_blocks' must be uint8 [O, I/32, 16], got {tuple(blocks.shape)}"
                              + ("; a 4-D [E, O, I/32, 16] stack is MoE experts, which qtool decodes (inspect) "
                                 "but does not convert" if blocks.dim() == 4 else ""), tensor="weight_blocks")
        o, g = blocks.shape[:2]
        codes = unpack_nibbles(blocks.reshape(o, g * GROUP // 2))
        return self._plain(codes, _scales(tensors, "weight_scales", fid, o, g * GROUP), params)

    def quantization_config(self, modules, dense: list[str] | None = None) -> dict:
        """transformers' Mxfp4Config as gpt-oss's config.json carries it."""
        return {"quant_method": "mxfp4", "modules_to_not_convert": list(dense or [])}


def decode_blocks(blocks: torch.Tensor, scales: torch.Tensor,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """gpt-oss `_blocks` uint8 [..., G, 16] and `_scales` uint8 [..., G] -> values [..., G * 32] in `dtype`
    (rows in their stored order: gpt-oss's [E, O, I]; transformers transposes to [E, I, O] when loading).
    Formed in fp32 (exact) and rounded once."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise FormatError(f"gpt-oss blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                          f"([..., G, 16] with [..., G])")
    v = e2m1_decode(unpack_nibbles(blocks))                      # [..., G, 32]
    v = v * e8m0_decode(scales.view(torch.uint8)).unsqueeze(-1)
    return v.reshape(*scales.shape[:-1], -1).to(dtype or torch.float32)


__all__ = ["GROUP", "CtMxfp4", "CtMxfp8", "GptOssMxfp4", "decode_blocks"]
