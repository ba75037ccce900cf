"""Hugging Face / vLLM / DeepSeek FP8, `quant_method: fp8`, format id "fp8" (docs/formats-float.md "fp8").

Tensors of one linear module (short names), O = out_features, I = in_features:

    weight            float8_e4m3fn [O, I]
    weight_scale_inv  float32 [ceil(O / bo), ceil(I / bi)]   2-D blocks, `weight_block_size` [bo, bi] in the
                                                              config ([128, 128] in DeepSeek-V3/R1, Qwen3 FP8)
  or
    weight_scale      float32 []                              one scale per tensor (AutoFP8 / vLLM per-tensor)
    input_scale       float32 []                              only with `activation_scheme: static`

W = weight * scale, formed in fp32 and rounded once to the model dtype (transformers' Fp8Dequantize,
DeepSeek's `weight_dequant`). The config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic" | "static", "weight_block_size": [bo, bi] (block files only), "modules_to_not_convert": [...]
(transformers) and "ignored_layers": [...] (vLLM) naming the linears left dense}.
Reading also accepts a per-tensor `weight_scale_inv` (transformers' own per-tensor layout) and per-channel
`weight_scale` [O, 1]; writing per-channel scales is refused (no engine reads them under quant_method fp8).
"""

from __future__ import annotations

from collections.abc import Mapping

from qtool.errors import FormatError
from qtool.formats.base import FormatSpec, expect, register
from qtool.formats.detection import FP8_DTYPES, Claims, Detected, Sig
from qtool.formats.scaled import ScaledPlain
from qtool.formats.scaled_format import ScaledFormat, infer_block
from qtool.lazy import lazy_module
from qtool.scheme import QuantScheme

torch = lazy_module("torch")


def fp8_quant_config(params: QuantScheme) -> dict:
    qc = params.extra.get("quant_config") if params.extra else None
    return qc if isinstance(qc, dict) else {}


def read_activation(t: dict[str, torch.Tensor], dynamic: bool | None) -> dict:
    """meta entries for the activation scheme: the input_scale tensor (kept in its dtype) when static."""
    s = t.get("input_scale")
    if s is None:
        return {"act_dynamic": True if dynamic is None else dynamic}
    if not s.dtype.is_floating_point or s.numel() != 1:
        raise FormatError(f"input_scale must be one float value, got {s.dtype} {tuple(s.shape)}", tensor="input_scale")
    return {"act_dynamic": False, "input_scale": s.reshape(())}


def _model_dtype(params: QuantScheme) -> str:
    d = params.extra.get("model_dtype") if params.extra else None
    return d if d in ("bfloat16", "float16", "float32") else "bfloat16"


@register
class Fp8(ScaledFormat):
    spec = FormatSpec(
        id="fp8",
        aliases=("hf_fp8", "fp8_block"),
        bits=(8,),
        tensors=("weight", "weight_scale_inv", "weight_scale", "input_scale"),
        required=("weight",),
        summary="HF/vLLM fp8: weight F8_E4M3 [O, I] + weight_scale_inv F32 [ceil(O/bo), ceil(I/bi)] "
                "(weight_block_size) or a per-tensor weight_scale F32 []",
        sym=True,
        asym=False,
    )
    elements = ("e4m3",)
    strategies = ("tensor", "block")
    scale_types = ("fp32",)
    compute = "fp32"
    default_block = (128, 128)

    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        d = detect_fp8(t, claims)
        return d if d is not None and d.format in ("fp8", "unknown") else None

    def pack(self, plain: ScaledPlain) -> dict[str, torch.Tensor]:
        p = self.require(plain)
        out = {"weight": p.codes.contiguous()}
        if p.strategy == "tensor":
            out["weight_scale"] = p.scales.reshape(()).contiguous()
        else:
            out["weight_scale_inv"] = p.scales.contiguous()
        s = p.meta.get("input_scale")
        if s is not None and not p.meta.get("act_dynamic", True):
            out["input_scale"] = s.to(torch.float32).reshape(()).contiguous()
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme) -> ScaledPlain:
        w = expect(tensors, "weight", "fp8", dtype=torch.float8_e4m3fn, dims=2)
        o, i = w.shape
        name = "weight_scale_inv" if "weight_scale_inv" in tensors else "weight_scale"
        s = expect(tensors, name, "fp8", dtype=torch.float32)
        qc = fp8_quant_config(params)
        bs = qc.get("weight_block_size")
        block = None
        if s.numel() == 1:
            block = (-1, -1)
        elif isinstance(bs, list) and len(bs) == 2 and s.dim() == 2:
            block = (int(bs[0]), int(bs[1]))
        else:
            block = infer_block(o, i, tuple(s.shape))
        if block is None:
            raise FormatError(f"fp8: {name} shape {tuple(s.shape)} is no per-tensor, per-channel or block grid of "
                              f"[{o}, {i}]", tensor=name, fix="give weight_block_size in the config")
        grid = s.reshape(1, 1) if block == (-1, -1) else s.reshape(o, 1) if block == (1, -1) else s
        dyn = qc.get("activation_scheme")
        meta = {"format": "fp8", "scale_name": name,
                **read_activation(tensors, None if dyn is None else dyn != "static")}
        try:
            return ScaledPlain(w, "e4m3", grid, "fp32", block, compute="float32",
                               out_dtype=_model_dtype(params), meta=meta)
        except FormatError as e:
            raise FormatError(f"fp8: {e.problem}", tensor=name,
                              fix="check weight_block_size in the config against the scale shape") from None

    def quantization_config(self, modules, dense: list[str] | None = None) -> dict:
        blocks = {tuple(m[2]["block"]) for m in modules if m[2] and m[2].get("strategy") == "block"}
        if len(blocks) > 1:
            raise FormatError(f"fp8 has one weight_block_size per checkpoint, but the modules use {sorted(blocks)}",
                              fix="convert with one --block")
        static = {bool(m[2] and m[2].get("act_dynamic") is False) for m in modules}
        if len(static) > 1:
            raise FormatError("fp8 has one activation_scheme per checkpoint, but some modules carry a static "
                              "input_scale and others none", fix="convert the static and dynamic parts apart")
        cfg = {"quant_method": "fp8", "fmt": "e4m3",
               "activation_scheme": "static" if static == {True} else "dynamic"}
        if blocks:
            cfg["weight_block_size"] = list(blocks.pop())
        if dense:
            cfg["modules_to_not_convert"] = list(dense)
            cfg["ignored_layers"] = list(dense)
        return cfg



# Per-tensor files follow vLLM (`weight_scale`); transformers 5 reads quant_method fp8 as weight_scale_inv in
# blocks (128 x 128 when weight_block_size is absent) and misreads them. compressed-tensors' per-tensor FP8 is
# read by both.
PER_TENSOR_NOTE = ("fp8 per-tensor scales are written as vLLM reads them (weight_scale); transformers 5 reads "
                   "quant_method fp8 as weight_scale_inv blocks and misreads this file: --to ct_fp8 --strategy "
                   "tensor writes a per-tensor file both load")


def loader_notes(modules) -> list[str]:
    """What the engines make of a file `quantization_config` describes: the per-tensor caveat."""
    tensor = any(m[2] and m[2].get("strategy") == "tensor" for m in modules)
    return [PER_TENSOR_NOTE] if tensor else []


def detect_fp8(t: Mapping[str, Sig], c: Claims) -> Detected | None:
    """An F8 weight beside its scale: HF fp8 (`weight_scale_inv`, or `weight_scale` under `quant_method: fp8`)
    or compressed-tensors float-quantized (`weight_scale` otherwise). The two share their tensors; the config
    tells them apart, so one function answers for both rows (fp8 and ct_fp8 ask it in turn)."""
    w = t.get("weight")
    if w is None or w[0] not in FP8_DTYPES or len(w[1]) != 2:
        return None
    o, i = w[1]
    notes: list[tuple[str, str]] = []
    if "weight_scale_inv" in t:
        fmt, scale = "fp8", t["weight_scale_inv"][1]
    elif "weight_scale" in t:
        fmt = "fp8" if c.quant_method == "fp8" else "ct_fp8"
        scale = t["weight_scale"][1]
    else:
        return Detected("unknown", notes=[("error", "FP8 weight without weight_scale or weight_scale_inv")])
    if w[0] != "F8_E4M3":
        notes.append(("error", f"{w[0]} weights: qtool reads the E4M3 layouts of fp8 and float-quantized only"))
    numel = 1
    for d in scale:
        numel *= d
    grid, grid_block = None, None
    if numel == 1:
        group, detail, grid = -1, "per-tensor scale", "tensor"
    elif tuple(scale) in ((o, 1), (o,)):
        group, detail, grid = -1, "per-channel scale", "channel"
    elif len(scale) == 2:
        block = infer_block(o, i, tuple(scale))
        bo, bi = c.block_size if c.block_size else block if block else (None, None)
        group, detail = bi, f"block {bo}x{bi} scales"
        if bo is not None and bi is not None:
            grid, grid_block = "block", (int(bo), int(bi))
        if c.block_size and (-(-o // bo) != scale[0] or -(-i // bi) != scale[1]):
            notes.append(("error", f"weight_block_size {list(c.block_size)} does not match scales {list(scale)} "
                                   f"for weight [{o}, {i}]"))
        if block is not None and block[0] == 1:
            group, detail, grid, grid_block = block[1], f"per-{block[1]} group scales", None, None
    else:
        group, detail = None, f"scale shape {list(scale)}"
    if c.format not in (None, fmt, "ct_fp8", "fp8"):
        notes.append(("error", f"config says {c.format} but the tensors are FP8 ({w[0]})"))
    return Detected(fmt, 8, group, True, False, i, o, i * o, detail=detail, notes=notes, weight_scale=grid,
                    block=grid_block)
