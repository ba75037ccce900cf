"""NVFP4: E2M1 codes, an E4M3 scale per 16 inputs, one fp32 global scale per tensor (docs/formats-float.md).

Two layouts hold the same bytes and differ only in names and in which way the global scale points:

`nvfp4` (compressed-tensors `nvfp4-pack-quantized`, vLLM, llm-compressor), tensors of one module:
    weight_packed        uint8 [O, I/2]         two E2M1 codes per byte, element 2i in the low nibble
    weight_scale         float8_e4m3fn [O, I/16]
    weight_global_scale  float32 [1]            W = code * (weight_scale / weight_global_scale)
    input_global_scale   float32 [1]            static activation global scale, only when calibrated
compressed-tensors' decompress forms weight_scale / weight_global_scale in fp32, multiplies the code in fp32
and rounds once to the model dtype (bf16): ScaledPlain compute "float32", global_op "div".

`modelopt_nvfp4` (NVIDIA ModelOpt, `hf_quant_config.json` / config `quant_algo: NVFP4`):
    weight               uint8 [O, I/2]         the same bytes as weight_packed
    weight_scale         float8_e4m3fn [O, I/16]
    weight_scale_2       float32 [1]            W = code * weight_scale * weight_scale_2
    input_scale          float32 [1]            the activation's global scale, multiplied
compressed-tensors' ModelOptNvfp4Converter turns one into the other by renaming and taking reciprocals
(weight_global_scale = 1 / weight_scale_2, input_global_scale = 1 / input_scale). A reciprocal is exact only
for a power of two, so the conversion is exact exactly when the global scales are powers of two (qtool's own
NVFP4 quantizer picks such global scales); otherwise it moves the global scale by up to half an fp32 ulp
and the plan says so (lossy).
"""

from __future__ import annotations

from qtool.errors import FormatError, NotRepresentable
from qtool.formats.base import FormatSpec, expect, format_id, register
from qtool.formats.detection import Claims, Detected
from qtool.formats.scaled import ScaledPlain
from qtool.formats.scaled_format import ScaledFormat
from qtool.lazy import lazy_module
from qtool.packing.minifloat import pack_nibbles, unpack_nibbles
from qtool.scheme import QuantScheme

torch = lazy_module("torch")

GROUP = 16
# weight dtype of the model a config names nothing else for: what compressed-tensors' decompress returns
DEFAULT_OUT = "bfloat16"


def is_power_of_two(x: torch.Tensor) -> bool:
    """True when the single fp32 value is a positive normal power of two (its reciprocal is exact)."""
    v = x.reshape(-1)[0].to(torch.float32)
    bits = int(v.view(torch.int32))
    exp = (bits >> 23) & 0xFF
    return bits > 0 and (bits & 0x7FFFFF) == 0 and 0 < exp < 254


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """fp32 [1] 1 / x, as compressed-tensors' converter computes it."""
    return (1 / x.reshape(1).to(torch.float32)).to(torch.float32)


def _codes_and_scales(packed: torch.Tensor, scale: torch.Tensor, fmt: str, wname: str) -> tuple:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise FormatError(f"{fmt}: '{wname}' must be uint8 [O, I/2], got {packed.dtype} {tuple(packed.shape)}",
                          tensor=wname)
    o, half = packed.shape
    i = 2 * half
    if scale.dtype != torch.float8_e4m3fn or scale.dim() != 2:
        raise FormatError(f"{fmt}: 'weight_scale' must be float8_e4m3fn [O, I/16], got {scale.dtype} "
                          f"{tuple(scale.shape)}", tensor="weight_scale")
    if tuple(scale.shape) != (o, -(-i // GROUP)):
        raise FormatError(f"{fmt}: 'weight_scale' {tuple(scale.shape)} does not cover {wname} {tuple(packed.shape)} "
                          f"(one scale per {GROUP} of {i} inputs: ({o}, {-(-i // GROUP)}))", tensor="weight_scale",
                          fix="the file is not NVFP4 or is truncated")
    return unpack_nibbles(packed), scale


def _global(t: dict, name: str, fmt: str) -> torch.Tensor:
    g = expect(t, name, fmt)
    if g.numel() != 1 or not g.is_floating_point():
        raise FormatError(f"{fmt}: '{name}' must be one float value, got {g.dtype} {tuple(g.shape)}", tensor=name)
    return g.reshape(1).to(torch.float32)


def _out_dtype(params: QuantScheme | None) -> str:
    d = (params.extra or {}).get("dtype") if params is not None else None
    return d if d in ("bfloat16", "float16", "float32") else DEFAULT_OUT


class _Nvfp4(ScaledFormat):
    """Shared checks: E2M1 codes, E4M3 scales over (1, 16), one fp32 global scale."""

    elements = ("e2m1",)
    strategies = ("group",)
    scale_types = ("e4m3",)
    compute = "fp32"
    default_block = (1, GROUP)

    op: str  # the global scale's direction in this layout: "div" or "mul"
    weight_name: str
    global_name: str

    def _detect(self, t, claims: Claims) -> Detected:
        """The NVFP4 facts of a module whose packed weight is `weight_name` (the caller has matched it)."""
        fid = self.spec.id
        wdt, ws = t[self.weight_name]
        notes: list[tuple[str, str]] = []
        if len(ws) != 2:
            return Detected("unknown", notes=[("error", f"{fid}: '{self.weight_name}' {list(ws)} is not 2-D")])
        o, i = ws[0], ws[1] * 2
        sc = t.get("weight_scale")
        group = None
        if sc is None:
            notes.append(("error", f"{fid}: no weight_scale beside the packed E2M1 weight"))
        else:
            if sc[0] != "F8_E4M3":
                notes.append(("error", f"{fid}: weight_scale is {sc[0]}, NVFP4 block scales are F8_E4M3"))
            if len(sc[1]) == 2 and sc[1][0] == o and sc[1][1]:
                group = -(-i // sc[1][1])
                if sc[1][1] * GROUP != i:
                    notes.append(("error", f"{fid}: weight_scale {list(sc[1])} does not hold one scale per {GROUP} "
                                           f"of {i} inputs"))
            else:
                notes.append(("error", f"{fid}: weight_scale {list(sc[1])} does not match [{o}, {i // GROUP}]"))
        g = t.get(self.global_name)
        if g is None:
            notes.append(("error", f"{fid}: no {self.global_name} (the per-tensor fp32 global scale)"))
        elif g[0] != "F32" or _numel(g[1]) != 1:
            notes.append(("error", f"{fid}: {self.global_name} is {g[0]} {list(g[1])}, expected one F32 value"))
        claimed = format_id(claims.format) if claims.format else None
        if claimed not in (None, fid):
            notes.append(("error", f"config says {claims.format} but the tensors are {fid} ({self.weight_name} U8 "
                                   f"+ E4M3 weight_scale + {self.global_name})"))
        if claims.bits not in (None, 4):
            notes.append(("error", f"config says {claims.bits}-bit but NVFP4 codes are 4-bit"))
        return Detected(fid, 4, group, True, False, i, o, i * o, detail="NVFP4 (E2M1, E4M3 per 16, fp32 global)",
                        notes=notes)

    def check(self, plain) -> list[str]:
        if not isinstance(plain, ScaledPlain):
            # a header question about a dense weight's shape: readers need whole groups of 16
            return [] if plain.in_features % GROUP == 0 else [
                f"{self.spec.id} needs in_features to be a multiple of {GROUP}, not {plain.in_features}"]
        why = []
        if plain.element != "e2m1":
            why.append(f"{self.spec.id} stores e2m1 codes, not {plain.element}")
        if plain.scale_type != "e4m3" or plain.block != (1, GROUP):
            why.append(f"{self.spec.id} stores e4m3 scales per (1, {GROUP}), not {plain.scale_type} per {plain.block}")
        if plain.zeros is not None:
            why.append(f"{self.spec.id} is symmetric: no zero points")
        if plain.global_scale is None:
            why.append(f"{self.spec.id} needs a global scale")
        elif plain.global_op != self.op and not is_power_of_two(plain.global_scale):
            why.append(f"{self.spec.id} {'divides by' if self.op == 'div' else 'multiplies by'} its global scale; "
                       f"the source's {float(plain.global_scale.reshape(()))!r} is no power of two, so its "
                       f"reciprocal is not exact in fp32")
        act = plain.meta.get("input_scale")
        if act is not None and plain.global_op != self.op and not is_power_of_two(act):
            why.append(f"{self.spec.id} stores the activation's global scale the other way up; the source's "
                       f"{float(act.reshape(()))!r} is no power of two, so its reciprocal is not exact in fp32")
        if plain.in_features % GROUP:
            why.append(f"{self.spec.id} needs in_features to be a multiple of {GROUP}, not {plain.in_features}")
        if plain.compute != "float32":
            why.append(f"{self.spec.id} forms the product in float32, not {plain.compute}")
        return why

    def adapt(self, plain: ScaledPlain) -> tuple[ScaledPlain | None, list[str]]:
        """(plain with its global scale pointing this layout's way, []) when that is exact, else (None, why)."""
        why = self.check(plain)
        return (None, why) if why else (self._turn(plain), [])

    def require(self, plain: ScaledPlain, lossy: bool = False) -> ScaledPlain:
        """plain in this layout's convention; NotRepresentable unless exact, or `lossy` and only the global
        scale's reciprocal is inexact (then it is taken as compressed-tensors' ModelOpt converter takes it)."""
        why = self.check(plain)
        inverse_only = bool(why) and all("reciprocal" in w for w in why)
        if why and not (lossy and inverse_only):
            raise NotRepresentable(f"cannot store this weight as {self.spec.id}: " + "; ".join(why),
                                   fix="repack with --allow-lossy to take the reciprocal" if inverse_only else None)
        return self._turn(plain)

    def _turn(self, plain: ScaledPlain) -> ScaledPlain:
        if plain.global_op == self.op:
            return plain
        meta = dict(plain.meta)
        if meta.get("input_scale") is not None:
            meta["input_scale"] = reciprocal(meta["input_scale"])
        return plain.with_(global_scale=reciprocal(plain.global_scale), global_op=self.op, meta=meta)

    @staticmethod
    def _plain(codes, scale, g, op, input_scale, params, fmt) -> ScaledPlain:
        meta = {"format": fmt}
        if input_scale is not None:
            meta["input_scale"] = input_scale
        return ScaledPlain(codes, "e2m1", scale, "e4m3", (1, GROUP), "float32", _out_dtype(params),
                           global_scale=g, global_op=op, meta=meta)


@register
class CtNvfp4(_Nvfp4):
    spec = FormatSpec(
        id="nvfp4",
        aliases=("ct_nvfp4", "nvfp4-pack-quantized"),
        bits=(4,),
        tensors=("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
        required=("weight_packed", "weight_scale", "weight_global_scale"),
        summary="compressed-tensors nvfp4-pack-quantized: E2M1 pairs U8 [O, I/2], E4M3 scale per 16, fp32 "
                "global scale (divides)",
        group_sizes=(GROUP,),
        asym=False,
    )
    op = "div"
    weight_name = "weight_packed"
    global_name = "weight_global_scale"

    def detect(self, module: str, t, claims: Claims) -> Detected | None:
        """weight_packed U8 with an E4M3 weight_scale or a weight_global_scale (MXFP4's scale is U8 E8M0)."""
        wp, sc = t.get("weight_packed"), t.get("weight_scale")
        if wp is None or wp[0] != "U8":
            return None
        if "weight_global_scale" not in t and (sc is None or sc[0] != "F8_E4M3"):
            return None
        return self._detect(t, claims)

    def pack(self, plain: ScaledPlain, *, lossy: bool = False) -> dict[str, torch.Tensor]:
        p = self.require(plain, lossy)
        out = {"weight_packed": pack_nibbles(p.codes).contiguous(), "weight_scale": p.scales.contiguous(),
               "weight_global_scale": p.global_scale.reshape(1).contiguous()}
        if p.meta.get("input_scale") is not None:
            out["input_global_scale"] = p.meta["input_scale"].reshape(1).to(torch.float32).contiguous()
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme | None = None) -> ScaledPlain:
        fid = self.spec.id
        codes, scale = _codes_and_scales(expect(tensors, "weight_packed", fid), expect(tensors, "weight_scale", fid),
                                         fid, "weight_packed")
        g = _global(tensors, "weight_global_scale", fid)
        gi = _global(tensors, "input_global_scale", fid) if "input_global_scale" in tensors else None
        return self._plain(codes, scale, g, "div", gi, params, fid)

    def quantization_config(self, modules, dense: list[str] | None = None) -> dict:
        """compressed-tensors' NVFP4A16 preset (NVFP4 with static activation global scales when every module
        carries one: the NVFP4 preset's activations)."""
        names = [name for name, _s, _m in modules]
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP,
                   "strategy": "tensor_group", "dynamic": False, "observer": "minmax", "observer_kwargs": {},
                   "block_structure": None, "scale_dtype": "torch.float8_e4m3fn",
                   "zp_dtype": "torch.float8_e4m3fn"}
        acts = None
        if modules and all((m or {}).get("input_scale") for _n, _s, m in modules):
            acts = {**weights, "dynamic": "local", "observer": "static_minmax"}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "version": "0.20.0",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": names, "weights": weights, "input_activations": acts,
                                              "output_activations": None, "format": "nvfp4-pack-quantized"}},
                "ignore": list(dense or []), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
                "global_compression_ratio": None}


@register
class ModelOptNvfp4(_Nvfp4):
    spec = FormatSpec(
        id="modelopt_nvfp4",
        aliases=("modelopt_fp4", "modelopt-nvfp4"),
        bits=(4,),
        tensors=("weight", "weight_scale", "weight_scale_2", "input_scale"),
        required=("weight", "weight_scale", "weight_scale_2"),
        summary="ModelOpt NVFP4: E2M1 pairs U8 [O, I/2] as `weight`, E4M3 scale per 16, fp32 weight_scale_2 "
                "(multiplies)",
        group_sizes=(GROUP,),
        asym=False,
    )
    op = "mul"
    weight_name = "weight"
    global_name = "weight_scale_2"

    def detect(self, module: str, t, claims: Claims) -> Detected | None:
        """weight U8 [O, I/2] beside an E4M3 weight_scale (or a weight_scale_2): ModelOpt's NVFP4. A U8 weight
        is never dense."""
        w, sc = t.get("weight"), t.get("weight_scale")
        if w is None or w[0] != "U8":
            return None
        if "weight_scale_2" not in t and (sc is None or sc[0] != "F8_E4M3"):
            return None
        return self._detect(t, claims)

    def pack(self, plain: ScaledPlain, *, lossy: bool = False) -> dict[str, torch.Tensor]:
        p = self.require(plain, lossy)
        out = {"weight": pack_nibbles(p.codes).contiguous(), "weight_scale": p.scales.contiguous(),
               "weight_scale_2": p.global_scale.reshape(1).contiguous()}
        if p.meta.get("input_scale") is not None:
            out["input_scale"] = p.meta["input_scale"].reshape(1).to(torch.float32).contiguous()
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme | None = None) -> ScaledPlain:
        fid = self.spec.id
        codes, scale = _codes_and_scales(expect(tensors, "weight", fid), expect(tensors, "weight_scale", fid),
                                         fid, "weight")
        g = _global(tensors, "weight_scale_2", fid)
        gi = _global(tensors, "input_scale", fid) if "input_scale" in tensors else None
        return self._plain(codes, scale, g, "mul", gi, params, fid)

    def quantization_config(self, modules, dense: list[str] | None = None) -> dict:
        """config.json `quantization_config` in the flat form vLLM's ModelOptQuantConfigBase.from_config reads
        (quant_algo, group_size, `ignore` for the modules left dense; vllm-main modelopt.py)."""
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP, "kv_cache_scheme": None,
                "ignore": list(dense or [])}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def convert_lossy_note(plain: ScaledPlain, target: str) -> str | None:
    """The one line a plan shows when converting this NVFP4 weight to `target` moves its global scale."""
    if target in ("nvfp4", "modelopt_nvfp4") and plain.global_scale is not None:
        op = "div" if target == "nvfp4" else "mul"
        if plain.global_op != op and not is_power_of_two(plain.global_scale):
            return (f"global scale {float(plain.global_scale.reshape(()))!r} is inverted (1/x rounds in fp32): "
                    "dequantized values may move by one ulp")
    return None


__all__ = ["GROUP", "CtNvfp4", "ModelOptNvfp4", "convert_lossy_note", "is_power_of_two", "reciprocal"]
