"""compressed-tensors `float-quantized` (FP8 W8A8 / W8A16), format id "ct_fp8" (docs/formats-float.md).

Tensors of one linear module (short names), as compressed-tensors 0.20's NaiveQuantizationCompressor writes
them (the weight quantized to `weights.pytorch_dtype()`, the scale kept as the observer made it):

    weight             float8_e4m3fn [O, I]
    weight_scale       fp32/bf16/fp16: tensor [1], channel [O, 1], group [O, I/g], block [ceil(O/bo), ceil(I/bi)]
    input_scale        [1], only for static per-tensor activations (`input_activations.dynamic: false`)

W = weight.to(scale dtype) * weight_scale, formed in the scale's dtype (`forward._dequantize`); the result
is in the scale's dtype. The config group carries `weights` {num_bits 8, type "float", symmetric, strategy,
block_structure | group_size} and `input_activations` {dynamic per-token ("token"), per-token-group 128
("group", with 128x128 blocks: the FP8_BLOCK preset), or static per-tensor ("tensor")}; vLLM and
transformers read those to choose the activation quantization.
"""

from __future__ import annotations

from collections.abc import Mapping

from qtool.errors import FormatError
from qtool.formats.base import FormatSpec, expect, register
from qtool.formats.compressed_tensors import DENSE_SINCE
from qtool.formats.detection import Claims, Detected, Sig
from qtool.formats.fp8 import detect_fp8, read_activation
from qtool.formats.scaled import ScaledPlain
from qtool.formats.scaled_format import ScaledFormat, block_of, infer_block
from qtool.lazy import lazy_module
from qtool.scheme import QuantScheme

torch = lazy_module("torch")
_SCALE_TYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
_COMPUTE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def ct_schemes(params: QuantScheme, ct_type: str) -> list[tuple[dict, dict | None]]:
    """(weights, input_activations) of the config groups that quantize 8-bit `ct_type` weights; those whose
    targets name the module exactly (params.extra "module") first. `re:` targets are left to the shapes:
    inspect has already matched them with its bounded matcher, and a pattern from a file is not run here."""
    qc = params.extra.get("quant_config") if params.extra else None
    module = params.extra.get("module") if params.extra else None
    named, rest = [], []
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    for g in (groups or {}).values() if isinstance(groups, dict) else ():
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            continue
        w = g["weights"]
        if w.get("type") != ct_type or w.get("num_bits") != 8:
            continue
        ia = g.get("input_activations")
        entry = (w, ia if isinstance(ia, dict) else None)
        targets = g.get("targets") if isinstance(g.get("targets"), list) else []
        hit = module is not None and module in targets
        (named if hit else rest).append(entry)
    return named + rest


def _block_from(w: dict, o: int, i: int) -> tuple[int, int] | None:
    strat = w.get("strategy")
    try:
        if strat == "block" and w.get("block_structure"):
            return block_of("block", o, i, tuple(w["block_structure"]))
        if strat == "group" and w.get("group_size"):
            return block_of("group", o, i, group=w["group_size"])
        if strat in ("tensor", "channel"):
            return block_of(strat, o, i)
    except (TypeError, ValueError, IndexError):
        return None
    return None


class CtNaive(ScaledFormat):
    """compressed-tensors' naive-quantized family (float-quantized, int-quantized): the weight in its
    element dtype beside its scale."""

    ct_type = "float"
    ct_format = "float-quantized"
    element_dtype = "float8_e4m3fn"  # torch dtype name of the stored weight
    scale_types = ("fp32", "bf16", "fp16")
    compute = "scale"

    def pack(self, plain: ScaledPlain) -> dict[str, torch.Tensor]:
        p = self.require(plain)
        s = p.scales.reshape(1) if p.strategy == "tensor" else p.scales
        out = {"weight": p.codes.contiguous(), "weight_scale": s.contiguous()}
        if p.zeros is not None:
            out["weight_zero_point"] = (p.zeros.reshape(1) if p.strategy == "tensor" else p.zeros).contiguous()
        si = p.meta.get("input_scale")
        if si is not None and not p.meta.get("act_dynamic", True):
            out["input_scale"] = si.reshape(1).contiguous()
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme) -> ScaledPlain:
        fid = self.spec.id
        w = expect(tensors, "weight", fid, dtype=getattr(torch, self.element_dtype), dims=2)
        s = expect(tensors, "weight_scale", fid)
        o, i = w.shape
        st = _SCALE_TYPE.get(str(s.dtype))
        if st is None:
            raise FormatError(f"{fid}: weight_scale must be fp32/bf16/fp16, got {s.dtype}", tensor="weight_scale")
        schemes = ct_schemes(params, self.ct_type)
        block, ia = None, None
        for wd, a in schemes:
            b = _block_from(wd, o, i)
            if b is not None and _fits(b, o, i, s):
                block, ia = b, a
                break
        if block is None:
            block = infer_block(o, i, tuple(s.shape))
            ia = schemes[0][1] if len(schemes) == 1 else None
        if block is None or not _fits(block, o, i, s):
            raise FormatError(f"{fid}: weight_scale shape {tuple(s.shape)} matches no strategy of weight [{o}, {i}]",
                              tensor="weight_scale", fix="check the config group's strategy/block_structure")
        grid = s.reshape(1, 1) if block == (-1, -1) else s.reshape(o, 1) if block == (1, -1) else s
        zeros = tensors.get("weight_zero_point")
        if zeros is not None:
            if zeros.numel() != grid.numel() or zeros.dtype.is_floating_point:
                raise FormatError(f"{fid}: weight_zero_point {zeros.dtype} {tuple(zeros.shape)} does not match "
                                  f"weight_scale {tuple(s.shape)}", tensor="weight_zero_point")
            zeros = zeros.to(torch.int8).reshape(grid.shape)
            if not bool(zeros.any()):
                zeros = None  # an all-zero zero point is the symmetric scheme
        act = read_activation(tensors, None if ia is None else bool(ia.get("dynamic", True)))
        if ia is not None:
            act["act_strategy"] = ia.get("strategy")
            act["act_group_size"] = ia.get("group_size")
        meta = {"format": fid, **act}
        return ScaledPlain(w, self.elements[0], grid, st, block, compute=_COMPUTE[st], out_dtype=_COMPUTE[st],
                           zeros=zeros, meta=meta)

    def quantization_config(self, modules, dense: list[str] | None = None) -> dict:
        """One config group per (strategy, block, activation scheme), targeting modules by exact name."""
        groups: dict[tuple, list[str]] = {}
        for name, _scheme, meta in modules:
            meta = meta or {}
            key = (meta.get("strategy", "channel"), tuple(meta.get("block") or (1, -1)),
                   bool(meta.get("zeros")), meta.get("act_dynamic", True) is not False,
                   meta.get("act_strategy"), meta.get("act_group_size"))
            groups.setdefault(key, []).append(name)
        config_groups = {}
        for k, ((strategy, block, zeros, dynamic, a_strat, a_group), mods) in enumerate(
                sorted(groups.items(), key=lambda kv: -len(kv[1]))):
            weights = {"num_bits": 8, "type": self.ct_type, "symmetric": not zeros, "strategy": strategy,
                       "group_size": block[1] if strategy == "group" else None,
                       "block_structure": list(block) if strategy == "block" else None,
                       "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
            config_groups[f"group_{k}"] = {"targets": mods, "weights": weights,
                                           "input_activations": self._activations(strategy, block, dynamic,
                                                                                  a_strat, a_group),
                                           "output_activations": None, "format": self.ct_format}
        return {"quant_method": "compressed-tensors", "format": self.ct_format,
                "version": ".".join(map(str, DENSE_SINCE)) + ".0", "quantization_status": "compressed",
                "config_groups": config_groups, "ignore": list(dense or []), "kv_cache_scheme": None,
                "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None}

    def _activations(self, strategy, block, dynamic, a_strat, a_group) -> dict:
        """The input activation scheme: static per-tensor when an input_scale is stored; else what was read,
        or the presets' choice (per-token, per-token-group 128 beside 128-wide blocks)."""
        base = {"num_bits": 8, "type": self.ct_type, "symmetric": True, "actorder": None, "block_structure": None}
        if not dynamic:
            return base | {"strategy": "tensor", "group_size": None, "dynamic": False, "observer": "minmax"}
        if a_strat not in ("token", "group", "tensor"):
            a_strat = "group" if strategy == "block" and self.ct_type == "float" else "token"
            a_group = block[1] if a_strat == "group" else None
        return base | {"strategy": a_strat, "group_size": a_group if a_strat == "group" else None,
                       "dynamic": True, "observer": None}


def _fits(block: tuple[int, int], o: int, i: int, s: torch.Tensor) -> bool:
    from qtool.formats.scaled import scale_grid

    g = scale_grid(o, i, block)
    return s.numel() == g[0] * g[1] and (s.dim() == 2 and tuple(s.shape) == g or block in ((-1, -1), (1, -1)))


@register
class CtFp8(CtNaive):
    spec = FormatSpec(
        id="ct_fp8",
        aliases=("float-quantized",),
        bits=(8,),
        tensors=("weight", "weight_scale", "weight_zero_point", "input_scale"),
        required=("weight", "weight_scale"),
        summary="compressed-tensors float-quantized: weight F8_E4M3 [O, I] + weight_scale (tensor [1], channel "
                "[O, 1], group [O, I/g], block [ceil(O/bo), ceil(I/bi)])",
        sym=True,
        asym=False,
    )
    elements = ("e4m3",)
    strategies = ("tensor", "channel", "group", "block")
    default_block = (1, -1)

    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        d = detect_fp8(t, claims)
        return d if d is not None and d.format == "ct_fp8" else None
