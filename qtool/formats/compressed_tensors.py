"""compressed-tensors `pack-quantized` (vLLM / llm-compressor), format id "ct".

Tensors of one module (short names):
    weight_packed      int32 [O, ceil(I*b/32)]  codes packed along the input dim, LSB first; each stored field is
                                                the signed value + 2^(b-1), i.e. qtool's unsigned code q
    weight_scale       fp16/bf16/fp32 [O, n_groups]  (the model dtype)
    weight_zero_point  int32 [ceil(O*b/32), n_groups]  true zeros z (signed zp + 2^(b-1)) packed along dim 0,
                                                present only for asymmetric schemes
    weight_g_idx       int32 [I]  group of each input channel; only for actorder "group"
    weight_shape       int64 [2]  (O, I)

Two packings of the word stream exist (QuantScheme.extra "packing", or the config's "version"):
- "dense" (compressed-tensors >= 0.18): the continuous little-endian bit stream of FORMATS.md; a run of
  32 codes becomes b words, codes may straddle words (3/5/6/7-bit), the last run is zero-padded and only
  ceil(n*b/32) words are kept;
- "padded" (earlier releases): floor(32/b) codes per word at shifts b*j, the top 32 mod b bits unused.
The two are identical for 1, 2, 4 and 8 bits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from qtool.errors import FormatError
from qtool.formats.base import Format, FormatSpec, expect, register
from qtool.formats.detection import (
    Claims,
    Detected,
    Sig,
    activation_detail,
    activation_dtype,
    ct_activations_for,
    ct_scheme_for,
    exact_div,
    group_from,
)
from qtool.formats.plain import Plain
from qtool.lazy import lazy_module
from qtool.packing.bitstream import pack_stream, to_int32, to_uint32, unpack_stream
from qtool.scheme import QuantScheme

torch = lazy_module("torch")

DENSE_SINCE = (0, 18)
PACKINGS = ("dense", "padded")


def packing_for_version(version: str | None) -> str:
    """'dense' for compressed-tensors >= 0.18 (or an unknown version), else 'padded'."""
    if not version:
        return "dense"
    nums = [int(x) for x in re.findall(r"\d+", str(version))[:2]]
    if len(nums) < 2:
        return "dense"
    return "dense" if tuple(nums) >= DENSE_SINCE else "padded"


def packed_words(n: int, bits: int, packing: str) -> int:
    """Number of int32 words that hold n codes."""
    if packing == "dense":
        return -(-n * bits // 32)
    return -(-n // (32 // bits))


# --- word packing along the last dim ---------------------------------------------------------------
def _pack_last(codes: torch.Tensor, bits: int, packing: str) -> torch.Tensor:
    """uint8 codes [..., n] -> int32 words [..., packed_words(n)]."""
    n = codes.shape[-1]
    if packing == "padded":
        pf = 32 // bits
        words = -(-n // pf)
        c = torch.nn.functional.pad(codes.to(torch.int64), (0, words * pf - n))
        c = c.reshape(*codes.shape[:-1], words, pf)
        shifts = torch.arange(pf, dtype=torch.int64) * bits
        return to_int32((c << shifts).sum(-1))
    runs = -(-n // 32)
    c = codes if runs * 32 == n else torch.nn.functional.pad(codes, (0, runs * 32 - n))
    return pack_stream(c, bits, dim=-1)[..., : packed_words(n, bits, "dense")].contiguous()


def _unpack_last(words: torch.Tensor, bits: int, n: int, packing: str, what: str) -> torch.Tensor:
    """int32 words [..., w] -> uint8 codes [..., n]; w must be exactly packed_words(n)."""
    need = packed_words(n, bits, packing)
    if words.shape[-1] != need:
        raise FormatError(f"ct: '{what}' has {words.shape[-1]} words along the packed dim, but {n} {bits}-bit "
                          f"codes in the {packing} packing need {need}", tensor=what,
                          fix="check num_bits and the compressed-tensors version in the config")
    if packing == "padded":
        pf = 32 // bits
        shifts = torch.arange(pf, dtype=torch.int64) * bits
        c = (to_uint32(words).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return c.reshape(*words.shape[:-1], -1)[..., :n].to(torch.uint8)
    runs = -(-n // 32)
    w = torch.nn.functional.pad(words, (0, runs * bits - need)) if runs * bits != need else words
    return unpack_stream(w, bits, runs * 32, dim=-1)[..., :n].contiguous()


def pack_codes(codes: torch.Tensor, bits: int, dim: int, packing: str = "dense") -> torch.Tensor:
    """uint8 codes -> int32 words packed along `dim` (0 or 1), compressed-tensors order."""
    c = codes.movedim(dim, -1)
    return _pack_last(c, bits, packing).movedim(-1, dim).contiguous()


def unpack_codes(words: torch.Tensor, bits: int, n: int, dim: int, packing: str = "dense",
                 what: str = "weight_packed") -> torch.Tensor:
    """int32 words packed along `dim` -> uint8 codes with n entries along `dim`."""
    w = words.movedim(dim, -1)
    return _unpack_last(w, bits, n, packing, what).movedim(-1, dim).contiguous()


# --- the format ------------------------------------------------------------------------------------
@register
class CompressedTensors(Format):
    spec = FormatSpec(
        id="ct",
        aliases=("compressed-tensors",),
        bits=(2, 3, 4, 5, 6, 7, 8),
        tensors=("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"),
        required=("weight_packed", "weight_scale"),
        summary="compressed-tensors pack-quantized (vLLM / llm-compressor), int32 along input, zeros along dim 0",
        sym=True,
        asym=True,
        act_order=True,
    )

    def check(self, plain: Plain) -> list[str]:
        return super().check(plain) + plain.check_ranges()

    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        """Every module with a `weight_packed` that NVFP4 (asked before) left: pack-quantized when it is int32
        words beside a weight_scale, else an unknown layout with the reason. The header holds no bits: they
        come from the config group that targets the module, or from weight_g_idx's length."""
        if "weight_packed" not in t:
            return None
        c = claims
        wp_dt, wp = t["weight_packed"]
        weights, _gfmt, ignored = ct_scheme_for(c, module) if c.ct_groups else (None, None, False)
        if any(n not in t for n in self.spec.required) or len(wp) != 2:
            return Detected("unknown", notes=[("error", "weight_packed without a 2-D weight_scale")])
        if wp_dt != "I32":
            return Detected("unknown", notes=[("error", f"weight_packed is {wp_dt}; pack-quantized uses int32")])
        notes: list[tuple[str, str]] = []
        if ignored:
            notes.append(("warning", "module is on the compressed-tensors ignore list but is quantized"))
        sc = t["weight_scale"]
        o = wp[0]
        cbits = cgroup = csym = None
        cdesc = None
        if weights:
            cbits = weights.get("num_bits") if isinstance(weights.get("num_bits"), int) else None
            cgroup = weights.get("group_size") if isinstance(weights.get("group_size"), int) else None
            if weights.get("strategy") == "channel":
                cgroup = -1
            csym = weights.get("symmetric") if isinstance(weights.get("symmetric"), bool) else None
            cdesc = weights.get("actorder") not in (None, False, "static", "weight")
        else:
            cbits, cgroup, csym, cdesc = c.bits, c.group_size, c.sym, c.desc_act
        packing = packing_for_version(c.ct_version)
        n_groups = sc[1][1]
        gi = t.get("weight_g_idx")
        in_f = gi[1][0] if gi is not None and len(gi[1]) == 1 else None
        bits = cbits
        if in_f is not None:
            fits = [b for b in self.spec.bits if packed_words(in_f, b, packing) == wp[1]]
            if bits is None and len(fits) == 1:
                bits = fits[0]
            elif bits is not None and bits not in fits:
                notes.append(("error", f"config says {bits}-bit but weight_packed holds {wp[1]} words for {in_f} "
                                       "inputs"))
        elif bits is not None:
            if cgroup not in (None, -1) and n_groups > 1:
                cand = [i for i in range((n_groups - 1) * cgroup + 1, n_groups * cgroup + 1)
                        if packed_words(i, bits, packing) == wp[1]]
                in_f = cand[-1] if cand else None
            else:
                in_f = exact_div(wp[1] * 32, bits) if packing == "dense" else wp[1] * (32 // bits)
            if in_f is None:
                notes.append(("error", f"weight_packed {list(wp)} cannot hold {bits}-bit codes in {n_groups} "
                                       f"groups of {cgroup}"))
        else:
            notes.append(("warning", "pack-quantized without num_bits in the config: bits unknown from the header"))
        group, gnote = group_from(in_f, n_groups, cgroup)
        if gnote:
            notes.append(("error", gnote))
        sym = "weight_zero_point" not in t
        if csym is False and sym:
            notes.append(("error", "config says asymmetric but there is no weight_zero_point"))
        if csym is True and not sym:
            notes.append(("warning", "config says symmetric but the module stores weight_zero_point"))
        desc = gi is not None
        if cdesc is False and desc:
            notes.append(("warning", "config has no act-order but the module stores weight_g_idx"))
        if c.format not in (None, "ct"):
            notes.append(("error", f"config says {c.format} but the tensors are pack-quantized (int32 "
                                   "weight_packed)"))
        if "weight_shape" not in t:
            notes.append(("error", "weight_shape missing: the unpacked [O, I] cannot be recovered"))
        # W4A8 and the like: the layout is pack-quantized's, the config group also quantizes the activations
        acts = ct_activations_for(c, module) if c.ct_groups else {}
        text = activation_detail(acts)
        detail = f"pack-quantized ({packing})" + (f"; {text}" if text else "")
        return Detected("ct", bits, group, sym, desc, in_f, o, (in_f or 0) * o or None, detail=detail, notes=notes,
                        activations=activation_dtype(acts))

    def pack(self, plain: Plain, *, packing: str | None = None, sym: bool | None = None) -> dict[str, torch.Tensor]:
        """Plain -> tensors. `packing` defaults to what the Plain was read with (meta "ct_packing"), else
        dense. `sym` (default: plain.sym) decides whether weight_zero_point is written; a config group that
        declares `symmetric: false` needs it on every module."""
        self.require(plain)
        packing = packing or plain.meta.get("ct_packing") or "dense"
        if packing not in PACKINGS:
            raise FormatError(f"ct: unknown packing '{packing}'", fix=f"use one of {PACKINGS}")
        b = plain.bits
        out = {
            "weight_packed": pack_codes(plain.qweight, b, 1, packing),
            "weight_scale": plain.scales.contiguous(),
        }
        if not (plain.sym if sym is None else sym):
            out["weight_zero_point"] = pack_codes(plain.zeros_or_midpoint(), b, 0, packing)
        if plain.desc_act:
            out["weight_g_idx"] = plain.g_idx.to(torch.int32).contiguous()
        out["weight_shape"] = torch.tensor([plain.out_features, plain.in_features], dtype=torch.int64)
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme) -> Plain:
        packed = expect(tensors, "weight_packed", "ct", dtype=torch.int32, dims=2)
        scales = expect(tensors, "weight_scale", "ct", dims=2)
        o = packed.shape[0]
        if scales.shape[0] != o:
            raise FormatError(f"ct: weight_scale has {scales.shape[0]} rows but weight_packed has {o}",
                              tensor="weight_scale")
        packing = params.extra.get("packing") or packing_for_version(params.extra.get("version"))
        if packing not in PACKINGS:
            raise FormatError(f"ct: unknown packing '{packing}'", fix=f"use one of {PACKINGS}")
        in_features = self._in_features(tensors, o)
        bits = params.bits or self._infer_bits(packed.shape[1], in_features, packing)
        if bits not in self.spec.bits:
            raise FormatError(f"ct: num_bits {bits} is not supported", fix="use 2..8 bits")
        qweight = unpack_codes(packed, bits, in_features, 1, packing)
        n_groups = scales.shape[1]

        g_idx = tensors.get("weight_g_idx")
        if g_idx is not None:
            if g_idx.dim() != 1 or g_idx.shape[0] != in_features or g_idx.dtype.is_floating_point:
                raise FormatError(f"ct: weight_g_idx must be integer [{in_features}], got {g_idx.dtype} "
                                  f"{tuple(g_idx.shape)}", tensor="weight_g_idx")
            g_idx = g_idx.to(torch.int32)
        group_size = params.group_size
        if group_size is None:
            group_size = -1 if n_groups == 1 else -(-in_features // n_groups)

        zeros = None
        zp = tensors.get("weight_zero_point")
        if zp is not None:
            zeros = self._unpack_zeros(zp, bits, o, n_groups, packing)
        elif params.sym is False:
            raise FormatError("ct: the config says asymmetric but 'weight_zero_point' is missing",
                              tensor="weight_zero_point", fix="the checkpoint is incomplete or mislabelled")
        meta = {"format": "ct", "ct_packing": packing}
        if params.extra.get("version"):
            meta["ct_version"] = str(params.extra["version"])
        return Plain(qweight, scales, zeros, g_idx, bits, group_size, meta)

    def quantization_config(self, modules, dense=None) -> dict:
        """One config group per (bits, group size, sym, act-order) scheme, targeting its modules by exact
        name, largest group first; `ignore` names the linear modules kept dense."""
        groups: dict[tuple, list[str]] = {}
        for name, s, _meta in modules:
            groups.setdefault((s.bits, s.group_size, bool(s.sym), bool(s.desc_act)), []).append(name)
        config_groups = {}
        for k, ((bits, group, sym, desc), mods) in enumerate(sorted(groups.items(), key=lambda kv: -len(kv[1]))):
            config_groups[f"group_{k}"] = {
                "targets": mods,
                "weights": {"num_bits": bits, "type": "int", "symmetric": sym,
                            "group_size": None if group == -1 else group,
                            "strategy": "channel" if group == -1 else "group",
                            "actorder": "group" if desc else None, "dynamic": False, "observer": "minmax",
                            "observer_kwargs": {}, "block_structure": None},
                "input_activations": None, "output_activations": None, "format": "pack-quantized",
            }
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "version": ".".join(map(str, DENSE_SINCE)) + ".0", "quantization_status": "compressed",
                "config_groups": config_groups, "ignore": list(dense or ()), "kv_cache_scheme": None,
                "sparsity_config": {},
                "transform_config": {}, "global_compression_ratio": None}

    # --- helpers -------------------------------------------------------------------------------------
    @staticmethod
    def _in_features(tensors: dict[str, torch.Tensor], o: int) -> int:
        shape = tensors.get("weight_shape")
        if shape is None:
            raise FormatError("ct: missing tensor 'weight_shape' (need the unpacked [O, I])", tensor="weight_shape")
        if shape.dtype.is_floating_point or shape.numel() != 2:
            raise FormatError(f"ct: weight_shape must hold two integers, got {shape.dtype} {tuple(shape.shape)}",
                              tensor="weight_shape")
        so, si = (int(v) for v in shape.reshape(-1).tolist())
        if so != o or si <= 0:
            raise FormatError(f"ct: weight_shape ({so}, {si}) does not match {o} packed rows", tensor="weight_shape")
        return si

    def _infer_bits(self, words: int, n: int, packing: str) -> int:
        fits = [b for b in self.spec.bits if packed_words(n, b, packing) == words]
        if len(fits) != 1:
            raise FormatError(f"ct: cannot tell num_bits from {words} words for {n} inputs",
                              fix="give bits in the config (config_groups.*.weights.num_bits)")
        return fits[0]

    @staticmethod
    def _unpack_zeros(zp: torch.Tensor, bits: int, o: int, n_groups: int, packing: str) -> torch.Tensor:
        if zp.dim() != 2 or zp.shape[1] != n_groups:
            raise FormatError(f"ct: weight_zero_point shape {tuple(zp.shape)} does not match {n_groups} groups",
                              tensor="weight_zero_point")
        if zp.shape[0] == o and zp.dtype != torch.int32:
            # unpacked signed zero points (int8), as releases before zero-point packing stored them
            z = zp.to(torch.int64) + (1 << (bits - 1))
            if int(z.min()) < 0 or int(z.max()) >= 1 << bits:
                raise FormatError(f"ct: a zero point is outside the {bits}-bit range", tensor="weight_zero_point")
            return z.to(torch.uint8)
        if zp.dtype != torch.int32:
            raise FormatError(f"ct: weight_zero_point must be int32 (packed), got {zp.dtype}",
                              tensor="weight_zero_point")
        return unpack_codes(zp, bits, o, 0, packing, what="weight_zero_point")


# --- direct conversions (same bytes as the composition, without unpacking codes) ----------------------------
# GPTQ's qweight is the continuous little-endian stream along the input rows in runs of 32 codes; dense
# pack-quantized is that same stream along the input of each output row. With I a multiple of 32 (GPTQ
# needs it for 3-bit, and b | 32 makes every run whole anyway) weight_packed is qweight transposed, word for
# word. Symmetric weights without act-order need nothing else but the scales transposed.
def _uniform_word(bits: int, field: int) -> int:
    w = 0
    for j in range(32 // bits if 32 % bits == 0 else 0):
        w |= field << (bits * j)
    return w - (1 << 32) if w >= 1 << 31 else w


def from_gptq(tensors: dict[str, torch.Tensor], params: QuantScheme, src: str, dst: str = "ct"
              ) -> dict[str, torch.Tensor] | None:
    """gptq / gptq_v2 -> ct (dense) for symmetric weights without act-order; None when it does not apply."""
    if src not in ("gptq", "gptq_v2") or dst != "ct":
        return None
    qweight, qzeros, scales = (tensors.get(n) for n in ("qweight", "qzeros", "scales"))
    if qweight is None or qzeros is None or scales is None or qweight.dtype != torch.int32 \
            or qzeros.dtype != torch.int32 or scales.dim() != 2 or qweight.dim() != 2:
        return None
    n_groups, o = scales.shape
    bits = params.bits
    if bits not in (2, 4, 8) or qweight.shape[1] != o or qzeros.shape != (n_groups, o * bits // 32):
        return None
    i = qweight.shape[0] * 32 // bits
    mid = 1 << (bits - 1)
    if i % 32 or not bool((qzeros == _uniform_word(bits, mid - 1 if src == "gptq" else mid)).all()):
        return None
    g = tensors.get("g_idx")
    group = params.group_size
    if group is None:
        return None
    eff = i if group == -1 else group
    if g is not None and not torch.equal(g.to(torch.int64), torch.arange(i, dtype=torch.int64) // eff):
        return None
    if -(-i // eff) != n_groups:
        return None
    return {
        "weight_packed": qweight.t().contiguous(),
        "weight_scale": scales.t().contiguous(),
        "weight_shape": torch.tensor([o, i], dtype=torch.int64),
    }


def to_gptq(tensors: dict[str, torch.Tensor], params: QuantScheme, src: str = "ct", dst: str = "gptq_v2"
            ) -> dict[str, torch.Tensor] | None:
    """ct -> gptq / gptq_v2 for symmetric weights without act-order, b in {2, 4, 8}; None otherwise."""
    if src != "ct" or dst not in ("gptq", "gptq_v2"):
        return None
    if "weight_zero_point" in tensors or "weight_g_idx" in tensors:
        return None
    packed, scales, shape = (tensors.get(n) for n in ("weight_packed", "weight_scale", "weight_shape"))
    bits, group = params.bits, params.group_size
    if packed is None or scales is None or shape is None or bits not in (2, 4, 8) or group is None \
            or packed.dtype != torch.int32 or packed.dim() != 2 or shape.numel() != 2:
        return None
    o, i = (int(v) for v in shape.reshape(-1).tolist())
    pf = 32 // bits
    eff = i if group == -1 else group
    if packed.shape != (o, i // pf) or i % 32 or o % pf or i % eff or scales.shape != (o, i // eff):
        return None
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    mid = 1 << (bits - 1)
    return {
        "qweight": packed.t().contiguous(),
        "qzeros": torch.full((i // eff, o // pf), _uniform_word(bits, mid - 1 if dst == "gptq" else mid),
                             dtype=torch.int32),
        "scales": scales.t().contiguous(),
        "g_idx": (torch.arange(i, dtype=torch.int32) // eff).to(torch.int32),
    }


# (source format, target format) -> fn(tensors, params, src, dst) -> dict | None (None: compose instead).
FAST_PATHS = {
    ("gptq", "ct"): from_gptq,
    ("gptq_v2", "ct"): from_gptq,
    ("ct", "gptq"): to_gptq,
    ("ct", "gptq_v2"): to_gptq,
}
