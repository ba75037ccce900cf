"""Marlin layout `marlin`: GPTQ symmetric 4/8-bit (uint4b8 / uint8b128) and AWQ 4-bit with zero points,
stored already permuted for the Marlin kernel (IST-DASLab; vLLM gptq_marlin / awq_marlin).

Engines repack GPTQ/AWQ to this layout in GPU memory at load time; qtool writes it to disk, with a contract
(safetensors metadata + quantization_config, see `contract` / `quantization_config`) that names the source
layout so `qtool repack` converts it back byte for byte.

Tensors of one linear module; K = in_features, N = out_features, both after padding (Kp, Np); b = bits,
pf = 32/b, nG = number of groups after padding:

    qweight  int32 [Kp/16, Np*16/pf]  Marlin B: codes of q[K, N] (k-major, rows gathered by `perm` under
                                       act-order), tile-permuted per 16x64 block and packed pf per word
                                       (qtool.packing.marlin_perm, FORMATS.md "Marlin")
    scales   fp16/bf16/fp32 [nG, Np]   columns permuted in runs of 64 (`scale_perm`) when nG > 1, of 32
                                       (`scale_perm_single`) when there is one group (channelwise)
    qzeros   int32 [nG, Np*b/32]       only with zero points (AWQ-Marlin): true zeros permuted like grouped
                                       scales, interleaved per word, packed along N
    g_idx    int32 [Kp]                only under act-order: the SORTED group index, g_idx[perm] (what the
                                       kernel reads, vLLM's layer.g_idx after marlin_sort_g_idx)
    perm     int32 [Kp]                only under act-order: the row gather, argsort(g_idx) (stable), so
                                       row k of B is input channel perm[k] (vLLM's g_idx_sort_indices)
    shape    int64 [2]                 [N, K] before padding (always written)

Padding (vLLM `marlin_padded_nk`): a usable Marlin tile family needs (N % 64, K % 128) or (N % 128, K % 64);
other shapes are zero-padded to the cheaper family, K staying a multiple of the group size. Padded rows
and columns decode to exactly 0: padded scales and zeros are 0 and padded codes equal their zero point
(the midpoint 2^(b-1) when symmetric), so a padded module is a correct, larger weight. `shape` records the
original size and unpack crops it away.

Legacy files (AutoGPTQ / vLLM "marlin" method: `B`, `s`, 4-bit symmetric, no act-order) are read too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from qtool.errors import FormatError, NotRepresentable
from qtool.formats.base import Format, FormatSpec, expect, get_format, register
from qtool.formats.detection import Claims, Detected, Sig, bits_note, exact_div, group_from
from qtool.formats.plain import FLOAT_DTYPES, Plain
from qtool.lazy import lazy_module
from qtool.packing import marlin_perm as mp
from qtool.scheme import QuantScheme

torch = lazy_module("torch")

MARLIN_BITS = (4, 8)
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
CONTRACT_VERSION = "1"
SOURCE_KEY = "marlin.source"
PERM_KEY = "marlin.perm"


# --- shape planning -------------------------------------------------------------------------------------
def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_nk(n: int, k: int, group_size: int = -1) -> tuple[int, int]:
    """(Np, Kp): the smallest shape in a usable Marlin tile family, (N % 64, K % 128) or (N % 128, K % 64),
    K kept a multiple of the group size; ties broken by the smaller N + K (vLLM marlin_padded_nk)."""
    g = group_size if group_size > 0 else 1
    candidates = ((_round_up(n, 64), _round_up(k, math.lcm(128, g))),
                  (_round_up(n, 128), _round_up(k, math.lcm(64, g))))
    return min(candidates, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


@dataclass(frozen=True)
class MarlinPlan:
    """How one Plain is laid out: what `pack` writes and what `module_meta` reports."""

    bits: int
    group_size: int
    n: int
    k: int
    n_pad: int
    k_pad: int
    n_groups: int       # before padding
    n_groups_pad: int
    g_eff: int          # rows per group (K for one group)
    zero_points: bool   # qzeros written (AWQ-Marlin) or not (uint4b8 / uint8b128)
    act_order: bool
    source: str

    @property
    def padded(self) -> bool:
        return (self.n_pad, self.k_pad) != (self.n, self.k)

    @property
    def channelwise(self) -> bool:
        """One scale row: Marlin permutes it with scale_perm_single (vLLM: group_size == -1 or >= K)."""
        return self.n_groups_pad == 1


def source_of(plain: Plain) -> str:
    """The layout a Plain came from: meta "marlin.source", else meta "format", else by its zeros."""
    src = plain.meta.get(SOURCE_KEY) or plain.meta.get("format")
    if src and src != "marlin":
        return str(src)
    return "gptq" if plain.sym else "awq"


def plan(plain: Plain) -> MarlinPlan:
    """Decide padding, zero points and act-order for one Plain (no data is moved)."""
    src = source_of(plain)
    n, k = plain.out_features, plain.in_features
    n_pad, k_pad = padded_nk(n, k, plain.group_size if plain.n_groups > 1 else -1)
    g_eff = plain.effective_group_size
    extra_groups = 0 if plain.n_groups == 1 else (k_pad - k) // g_eff
    # An AWQ source keeps its qzeros even when every zero is the midpoint: the file stays AWQ-Marlin.
    zero_points = (not plain.sym) or (src == "awq" and plain.bits == 4)
    return MarlinPlan(plain.bits, plain.group_size, n, k, n_pad, k_pad, plain.n_groups,
                      plain.n_groups + extra_groups, g_eff, zero_points, plain.desc_act, src)


def module_meta(plain: Plain) -> dict:
    """Facts about one module for the checkpoint contract (JSON-able): source, bits, group_size,
    act_order, zero_points, shape [N, K] and padded_shape [Np, Kp]."""
    p = plan(plain)
    return {SOURCE_KEY: p.source, "bits": p.bits, "group_size": p.group_size, "act_order": p.act_order,
            "zero_points": p.zero_points, "shape": [p.n, p.k], "padded_shape": [p.n_pad, p.k_pad]}


# --- the format ---------------------------------------------------------------------------------------------
@register
class Marlin(Format):
    spec = FormatSpec(
        id="marlin",
        bits=MARLIN_BITS,
        tensors=("qweight", "scales", "qzeros", "g_idx", "perm", "shape"),
        required=("qweight", "scales", "shape"),
        summary="Marlin tiles (GPTQ sym 4/8-bit, AWQ 4-bit zeros): qweight int32 [K/16, N*16/pf] "
                "fragment-permuted, scales [nG, N] permuted, act-order perm [K], zero-padded shape [2]",
        group_sizes=MARLIN_GROUP_SIZES,
        act_order=True,
    )

    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        """qtool's Marlin files (qweight/scales, named marlin by the config or the `qtool.*` metadata) and the
        original Marlin's legacy B/s. Shapes are the padded ones; the contract's `marlin.padding` gives the
        module's [N, K]."""
        c = claims
        if not ("qweight" in t and c.format == "marlin" or {"B", "s"} <= t.keys()):
            return None
        bname = "B" if "B" in t else "qweight"
        sname = "s" if "s" in t else "scales"
        if sname not in t:
            return Detected("unknown", notes=[("error", f"Marlin '{bname}' without scales ('s' or 'scales')")])
        b, s = t[bname][1], t[sname][1]
        if len(b) != 2 or len(s) not in (1, 2):
            return Detected("unknown", notes=[("error", f"Marlin {bname} {list(b)} and {sname} {list(s)}: a Marlin "
                                                        f"weight is 2-D tiles [K/16, N*16*bits/32] with 1-D or "
                                                        f"2-D scales [groups, N]")])
        n_groups, n = s if len(s) == 2 else (1, s[0])
        k = b[0] * 16
        bits = exact_div(b[1] * 32, n * 16)
        notes: list[tuple[str, str]] = []
        if bits not in MARLIN_BITS:
            notes.append(("error", f"Marlin {bname} {list(b)} with {n} outputs gives {bits}-bit codes "
                                   f"({' or '.join(map(str, MARLIN_BITS))} expected)"))
        if c.format not in (None, "marlin") and "B" in t:
            notes.append(("error", f"config says {c.format} but the tensors are Marlin's B/s"))
        pad = c.marlin_padding.get(module) or (c.marlin_padding.get("") if len(c.marlin_padding) == 1 else None)
        k_pad = k
        if pad and pad[2:] == [n, k]:
            n, k = pad[0], pad[1]
        group, gnote = group_from(k_pad, n_groups, c.group_size)
        if gnote:
            notes.append(("error", gnote))
        notes += bits_note(c, bits)
        legacy = bname == "B"
        sym = "qzeros" not in t
        desc = "perm" in t or "g_idx" in t
        if c.desc_act is not None and c.desc_act != desc and not legacy:
            notes.append(("warning", f"contract says act_order {str(c.desc_act).lower()} but the module "
                                     f"{'has' if desc else 'has no'} perm/g_idx"))
        return Detected("marlin", bits, group, sym, desc, k, n, k * n,
                        detail="legacy marlin (B/s)" if legacy else "qtool marlin contract", notes=notes)

    def check(self, plain: Plain) -> list[str]:
        why = super().check(plain)
        if plain.n_groups == 1:
            # A single group is channelwise to the kernel, whatever size the Plain calls it.
            why = [w for w in why if "group sizes are" not in w]
        if plain.bits in MARLIN_BITS and not plain.sym and plain.bits != 4:
            why.append(f"marlin stores zero points for 4-bit only (AWQ-Marlin); this {plain.bits}-bit weight "
                       f"is asymmetric")
        why += plain.check_ranges()
        return why

    # --- pack ------------------------------------------------------------------------------------------
    def pack(self, plain: Plain) -> dict[str, torch.Tensor]:
        """Plain -> {"qweight", "scales"[, "qzeros"][, "g_idx", "perm"], "shape"} (module docstring).

        Raises NotRepresentable listing every reason from check().
        """
        why = self.check(plain)
        if why:
            raise NotRepresentable("cannot store this weight as marlin: " + "; ".join(why),
                                   fix="marlin takes 4/8-bit symmetric or 4-bit zero-point weights with group "
                                       "size -1/32/64/128; keep the source format")
        p = plan(plain)
        b, mid = p.bits, 1 << (p.bits - 1)
        q = plain.qweight.t()  # [K, N]
        out: dict[str, torch.Tensor] = {}
        perm = None
        g_sorted = None
        if p.act_order:
            perm = _act_order_perm(plain)
            q = q.index_select(0, perm)
            g_sorted = plain.group_index().index_select(0, perm)

        zeros = None
        if p.zero_points:
            zeros = _pad2(plain.zeros_or_midpoint().t(), p.n_groups_pad, p.n_pad, 0)  # [nGp, Np]
        # Padded codes equal their zero point so every padded weight decodes to exactly 0.
        q_pad = torch.full((p.k_pad, p.n_pad), 0 if p.zero_points else mid, dtype=torch.uint8)
        q_pad[: p.k, : p.n] = q
        if p.zero_points and p.k_pad > p.k:
            pad_groups = _pad_rows_groups(p)
            q_pad[p.k:, :] = zeros.index_select(0, pad_groups)
        out["qweight"] = mp.codes_to_b(q_pad, b)
        scales = _pad2(plain.scales.t(), p.n_groups_pad, p.n_pad, 0)
        out["scales"] = mp.permute_scales(scales, p.channelwise).contiguous()
        if zeros is not None:
            out["qzeros"] = mp.zeros_to_marlin(zeros, b)
        if perm is not None:
            tail = torch.arange(p.k, p.k_pad, dtype=torch.int64)
            out["g_idx"] = torch.cat([g_sorted, _pad_rows_groups(p)]).to(torch.int32)
            out["perm"] = torch.cat([perm, tail]).to(torch.int32)
        out["shape"] = torch.tensor([p.n, p.k], dtype=torch.int64)
        return out

    def quantization_config(self, modules, dense=None) -> dict:
        """The majority scheme of the Marlin modules as the base config, with the GPTQ writers' per-module
        `dynamic` overrides for modules that differ in bits, group size, zero points (sym) or act-order, and
        exclusions for the linear modules kept dense. Loaders take one integer bits/group_size and one
        sym/desc_act from the base; the overrides are what GPTQModel's QuantizeConfig and vLLM's GPTQ paths
        parse per module, and what qtool's own reader applies before it reads a module."""
        from qtool.formats.gptq import majority_and_overrides

        metas = {name: meta for name, _s, meta in modules if meta}
        summary = summarize(metas)
        if isinstance(summary[SOURCE_KEY], list) and "awq" in summary[SOURCE_KEY]:
            # one quant_method names the family; the planner refuses such a mix before this point
            raise FormatError(f"marlin: modules come from {', '.join(summary[SOURCE_KEY])}; one config names "
                              "either the gptq or the awq family", fix="convert one family at a time (--include)")
        base, dynamic = majority_and_overrides([(name, scheme_of(m)) for name, m in metas.items()], dense or ())
        cfg = quantization_config(summary)  # summary["scheme"] is `base`: the same majority of the same list
        if dynamic:
            cfg["dynamic"] = dynamic
        if cfg["quant_method"] == "gptq":  # vLLM and GPTQModel build the LM head packed only under this flag
            from qtool.formats.gptq import is_lm_head

            cfg["lm_head"] = any(is_lm_head(name) for name in metas)
        if dense and cfg["quant_method"] == "awq":
            cfg["modules_to_not_convert"] = list(dense)
        return cfg

    # --- unpack ----------------------------------------------------------------------------------------
    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme) -> Plain:
        """Marlin tensors (qtool names, or legacy B/s) -> the exact original Plain, padding cropped.

        meta: "format" = "marlin", "marlin.source" (params.extra["marlin.source"], else "awq" when qzeros are
        present, else "gptq"), "marlin.perm" (int64 [K], act-order only) so that pack(unpack(x)) == x.
        """
        lay = read_layout(tensors, params)
        B, scales, bits = lay.B, lay.scales, lay.bits
        n, k, n_pad, k_pad, n_groups = lay.n, lay.k, lay.n_pad, lay.k_pad, lay.n_groups
        n_groups_pad, channelwise, group_size, g_eff = lay.n_groups_pad, lay.channelwise, lay.group_size, lay.g_eff

        q = mp.b_to_codes(B, bits, k_pad, n_pad)  # [Kp, Np], rows in stored (sorted) order
        g_idx = None
        perm_meta = None
        if "perm" in tensors or "g_idx" in tensors:
            perm = expect(tensors, "perm", "marlin", dims=1).to(torch.int64) if "perm" in tensors else \
                torch.arange(k_pad)  # a sorted g_idx alone: rows already in group order
            g_sorted = expect(tensors, "g_idx", "marlin", dims=1).to(torch.int64)
            if perm.numel() != k_pad or g_sorted.numel() != k_pad:
                raise FormatError(f"marlin: perm/g_idx have {perm.numel()}/{g_sorted.numel()} entries, B has "
                                  f"{k_pad} rows", tensor="perm")
            if not torch.equal(torch.sort(perm).values, torch.arange(k_pad)) or \
                    not torch.equal(perm[k:], torch.arange(k, k_pad)):
                raise FormatError("marlin: perm is not a permutation of the input rows (padded rows last)",
                                  tensor="perm")
            natural = torch.empty_like(q)
            natural[perm] = q
            q = natural
            g_nat = torch.empty_like(g_sorted)
            g_nat[perm] = g_sorted
            g_idx = g_nat[:k].to(torch.int32)
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups):
                raise FormatError(f"marlin: g_idx spans [{int(g_idx.min())}, {int(g_idx.max())}] but there are "
                                  f"{n_groups} groups", tensor="g_idx")
            perm_meta = perm[:k].clone()
        codes = q[:k, :n].t().contiguous()
        s = mp.unpermute_scales(scales, channelwise)[:n_groups, :n].t().contiguous()
        zeros = None
        if "qzeros" in tensors:
            qz = expect(tensors, "qzeros", "marlin", dtype=torch.int32, dims=2)
            if qz.shape[0] != n_groups_pad:
                raise FormatError(f"marlin: qzeros has {qz.shape[0]} rows, scales {n_groups_pad}",
                                  tensor="qzeros")
            zeros = mp.zeros_from_marlin(qz, bits, n_pad)[:n_groups, :n].t().contiguous()
        source = (params.extra or {}).get(SOURCE_KEY) or ("awq" if zeros is not None else "gptq")
        if zeros is not None and bool((zeros == (1 << (bits - 1))).all()):
            zeros = None  # symmetric; source "awq" still brings the qzeros back on pack
        if g_idx is not None:
            trivial = torch.arange(k, dtype=torch.int64) // g_eff
            if torch.equal(g_idx.to(torch.int64), trivial):
                g_idx = None
        meta = {"format": "marlin", SOURCE_KEY: source}
        if perm_meta is not None:
            meta[PERM_KEY] = perm_meta
        return Plain(codes, s, zeros, g_idx, bits, group_size, meta)


# --- helpers ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Shapes of one stored Marlin module, read from its tensors and QuantScheme (no data decoded)."""

    B: torch.Tensor
    scales: torch.Tensor
    bits: int
    n: int
    k: int
    n_pad: int
    k_pad: int
    n_groups: int
    n_groups_pad: int
    group_size: int
    g_eff: int

    @property
    def channelwise(self) -> bool:
        return self.n_groups_pad == 1


def read_layout(tensors: dict[str, torch.Tensor], params: QuantScheme) -> Layout:
    """Validate shapes and dtypes; bits and group_size come from params or are inferred from shapes."""
    b_name = "B" if "B" in tensors and "qweight" not in tensors else "qweight"
    s_name = "s" if "s" in tensors and "scales" not in tensors else "scales"
    B = expect(tensors, b_name, "marlin", dtype=torch.int32, dims=2)
    scales = expect(tensors, s_name, "marlin", dims=2)
    if scales.dtype not in FLOAT_DTYPES:
        raise FormatError(f"marlin: '{s_name}' must be fp16/bf16/fp32, got {scales.dtype}", tensor=s_name)
    n_groups_pad, n_pad = scales.shape
    k_pad = B.shape[0] * mp.TILE
    words = B.shape[1]
    pf = n_pad * mp.TILE // words if words and (n_pad * mp.TILE) % words == 0 else 0
    bits = params.bits if params.bits is not None else (32 // pf if pf in (4, 8) else 0)
    if bits not in MARLIN_BITS or words * 32 != n_pad * mp.TILE * bits:
        raise FormatError(f"marlin: {b_name} {tuple(B.shape)} with {n_pad} scale columns is not 4- or 8-bit "
                          f"Marlin (config bits: {params.bits})", tensor=b_name)
    if n_pad % mp.BLOCK_N or n_groups_pad == 0:
        raise FormatError(f"marlin: scales {tuple(scales.shape)}: N must be a multiple of 64 with >= 1 group",
                          tensor=s_name)
    n, k = n_pad, k_pad
    if "shape" in tensors:
        shape = expect(tensors, "shape", "marlin", dims=1)
        if shape.numel() != 2:
            raise FormatError(f"marlin: 'shape' must hold [N, K], got {shape.tolist()}", tensor="shape")
        n, k = (int(v) for v in shape.tolist())
        if not (0 < n <= n_pad and 0 < k <= k_pad):
            raise FormatError(f"marlin: shape [N, K] = {[n, k]} does not fit the padded [{n_pad}, {k_pad}]",
                              tensor="shape")
    group_size = params.group_size
    if group_size is None:
        group_size = -1 if n_groups_pad == 1 else k_pad // n_groups_pad
    g_eff = k if group_size == -1 else group_size
    n_groups = n_groups_pad if n_groups_pad == 1 else n_groups_pad - (k_pad - k) // g_eff
    if n_groups <= 0 or g_eff <= 0:
        raise FormatError(f"marlin: {n_groups_pad} scale rows cannot cover K={k} padded to {k_pad} with "
                          f"group_size {group_size}", tensor=s_name)
    return Layout(B, scales, bits, n, k, n_pad, k_pad, n_groups, n_groups_pad, group_size, g_eff)


def _pad2(t: torch.Tensor, rows: int, cols: int, value) -> torch.Tensor:
    if tuple(t.shape) == (rows, cols):
        return t.contiguous()
    out = torch.full((rows, cols), value, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _pad_rows_groups(p: MarlinPlan) -> torch.Tensor:
    """int64 [Kp - K]: the group of each padded row (new groups after the last, or 0 when channelwise)."""
    r = torch.arange(p.k_pad - p.k, dtype=torch.int64)
    if p.channelwise:
        return torch.zeros_like(r)
    return p.n_groups + r // p.g_eff


def _act_order_perm(plain: Plain) -> torch.Tensor:
    """int64 [K]: the row order under act-order. A perm carried in meta (read from a Marlin file) is kept
    when it still sorts g_idx, so pack(unpack(x)) == x even for a perm another tool chose; otherwise the
    stable argsort of g_idx."""
    g = plain.group_index()
    carried = plain.meta.get(PERM_KEY)
    if isinstance(carried, torch.Tensor) and carried.numel() == g.numel():
        c = carried.to(torch.int64)
        if torch.equal(torch.sort(c).values, torch.arange(g.numel())):
            gs = g.index_select(0, c)
            if bool((gs[1:] >= gs[:-1]).all()):
                return c
    return torch.argsort(g, stable=True)


# --- checkpoint contract ------------------------------------------------------------------------------------
def summarize(metas: dict[str, dict]) -> dict:
    """Merge `module_meta` of every Marlin module ({module prefix: meta}) into the plain_meta `contract`
    and `quantization_config` take. Mixed sources/bits/groups are kept as lists: the contract records them
    so, and its readers then take each module's facts from the config (its `dynamic` overrides) and tensors.
    "scheme" is the majority (bits, group_size, sym, desc_act), the base the config states; act_order and
    zero_points are its values, so that the contract and the config's base agree (inspect compares them)."""
    from qtool.formats.gptq import majority

    if not metas:
        raise FormatError("marlin contract: no Marlin modules to describe")

    def one(key):
        vals = sorted({json.dumps(m[key]) for m in metas.values()})
        return json.loads(vals[0]) if len(vals) == 1 else [json.loads(v) for v in vals]

    padded = {mod: m["shape"] + m["padded_shape"] for mod, m in metas.items()
              if m["shape"] != m["padded_shape"]}
    scheme = majority(scheme_of(m) for m in metas.values())
    return {SOURCE_KEY: one(SOURCE_KEY), "bits": one("bits"), "group_size": one("group_size"),
            "act_order": scheme[3], "zero_points": not scheme[2], "padded": padded, "scheme": scheme}


def scheme_of(meta: dict) -> tuple:
    """(bits, group_size, sym, desc_act) of one module's `module_meta`, as a GPTQ-style config states it: sym
    is "no zero points" (uint4b8 / uint8b128)."""
    return meta["bits"], meta["group_size"], not meta["zero_points"], bool(meta["act_order"])


def contract(plain_meta: dict) -> dict[str, str]:
    """safetensors metadata (str -> str) a qtool Marlin checkpoint carries.

    plain_meta: `summarize(...)` output, or one `module_meta(plain)` (keys "marlin.source", "bits",
    "group_size", "act_order", "zero_points", optional "padded" {module: [N, K, Np, Kp]}). Of a summary,
    mixed sources, bits and group sizes are written as JSON lists (readers then take each module's from the
    config's `dynamic` and its tensors) and act_order / zero_points are the base scheme's, as in the config.
    The per-module truth (original shape, perm) is in each module's tensors; these keys say what the file is
    and where it came from, so readers neither mistake B for a GPTQ qweight nor lose the way back.
    """
    from qtool import __version__

    padded = plain_meta.get("padded") or {}
    if not padded and "padded_shape" in plain_meta and plain_meta["padded_shape"] != plain_meta["shape"]:
        padded = {"": plain_meta["shape"] + plain_meta["padded_shape"]}
    return {
        "format": "pt",
        "qtool.version": __version__,
        "qtool.format": "marlin",
        "qtool.marlin.contract": CONTRACT_VERSION,
        "qtool.marlin.source": _text(plain_meta.get(SOURCE_KEY, "gptq")),
        "qtool.marlin.bits": _text(plain_meta["bits"]),
        "qtool.marlin.group_size": _text(plain_meta["group_size"]),
        "qtool.marlin.act_order": _text(bool(plain_meta.get("act_order", False))),
        "qtool.marlin.zero_points": _text(bool(plain_meta.get("zero_points", False))),
        "qtool.marlin.padding": json.dumps(padded, separators=(",", ":"), sort_keys=True),
        "qtool.marlin.layout": "qweight=B int32 [Kp/16,Np*16/pf] mma.m16n8k16 fragment order "
                               "(vLLM gptq_marlin_repack); scales scale_perm/scale_perm_single; "
                               "qzeros awq_marlin; g_idx sorted + perm; shape [N,K] before padding",
    }


def quantization_config(plain_meta: dict) -> dict:
    """config.json `quantization_config` for a qtool Marlin checkpoint.

    `checkpoint_format`/`format` "marlin" is the ecosystem's flag for "tensors already Marlin-packed" (vLLM
    reads `checkpoint_format == "marlin"` or `is_marlin_format`); a GPTQ/AWQ loader that does not know it
    refuses instead of reading B as a GPTQ qweight. quant_method follows the source family. The `qtool`
    entry repeats the contract for tools that read only the config.

    plain_meta: one `module_meta`, or a `summarize` output, whose "scheme" (bits, group_size, sym, desc_act)
    is the base the config states (Marlin.quantization_config puts the majority there; without it the
    summary's own values, which must then be single).
    """
    src = plain_meta.get(SOURCE_KEY, "gptq")
    bits, group, sym, desc = plain_meta.get("scheme") or scheme_of(plain_meta)
    if isinstance(bits, list) or isinstance(group, list):
        raise FormatError("marlin: mixed bits or group sizes need a base scheme (Marlin.quantization_config "
                          "writes the majority and per-module `dynamic` overrides)")
    zp = not sym
    if src == "awq":
        cfg = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": zp,
               "version": "marlin", "format": "marlin", "desc_act": desc, "sym": not zp}
    else:
        cfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc, "sym": not zp,
               "checkpoint_format": "marlin", "format": "marlin", "is_marlin_format": True,
               "pack_dtype": "int32", "lm_head": False}
    cfg["qtool"] = {k.removeprefix("qtool."): v for k, v in contract(plain_meta).items()
                    if k.startswith("qtool.marlin.")}
    return cfg


def params_from_contract(metadata: dict[str, str] | None, config: dict | None = None) -> QuantScheme:
    """QuantScheme for `Marlin.unpack` from a checkpoint's safetensors metadata (or its config's "qtool"
    entry): bits, group_size, act-order and the source format (extra["marlin.source"])."""
    md = dict(metadata or {})
    q = (config or {}).get("qtool") if isinstance(config, dict) else None
    if isinstance(q, dict):
        for k, v in q.items():
            md.setdefault(f"qtool.{k}", v)

    def get_int(key):
        v = md.get(key)
        try:
            return int(v) if v is not None else None
        except (TypeError, ValueError):
            return None  # mixed values are listed; the tensors' shapes decide

    extra = {}
    src = md.get("qtool.marlin.source")
    if src and not str(src).startswith("["):  # a list names mixed sources: each module's tensors decide
        extra[SOURCE_KEY] = str(src)
    act = md.get("qtool.marlin.act_order")
    return QuantScheme(bits=get_int("qtool.marlin.bits"), group_size=get_int("qtool.marlin.group_size"),
                       desc_act=None if act is None else str(act).lower() == "true", extra=extra)


def _text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


# --- direct conversions (same bytes as the composition, without unpacking codes) ---------------------------
def _sym_word(bits: int, stored: int) -> int:
    """int32 bit pattern of a qzeros word whose every field holds `stored`."""
    w = sum(stored << (bits * i) for i in range(32 // bits))
    return w - (1 << 32) if w >= 1 << 31 else w


def from_gptq(tensors: dict[str, torch.Tensor], params: QuantScheme, src: str, dst: str = "marlin", *,
              out: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
    """gptq / gptq_v2 -> marlin for symmetric weights without act-order, moving packed bytes only.

    Returns exactly `Marlin().pack(get_format(src).unpack(tensors, params))`, or None when this path does not
    apply (asymmetric zeros, act-order, other bits, or anything the composition would refuse) — the caller
    then composes, which also produces the right error.
    out: optional int32 buffer with at least qweight's element count (Marlin B has the same count when no
    padding is needed); B is written into its front, so a streaming caller can reuse one buffer.
    """
    from qtool.formats import gptq as gq

    if src not in ("gptq", "gptq_v2") or dst != "marlin":
        return None
    qweight, qzeros, scales = (tensors.get(n) for n in ("qweight", "qzeros", "scales"))
    if qweight is None or qzeros is None or scales is None or qweight.dtype != torch.int32 \
            or qzeros.dtype != torch.int32 or scales.dim() != 2 or scales.dtype not in FLOAT_DTYPES:
        return None
    n_groups, n = scales.shape
    bits = params.bits or (qzeros.shape[1] * 32 // n if n else 0)
    if bits not in MARLIN_BITS or qweight.shape[1] != n or qzeros.shape != (n_groups, n * bits // 32):
        return None
    mid = 1 << (bits - 1)
    if not bool((qzeros == _sym_word(bits, mid - 1 if src == "gptq" else mid)).all()):
        return None  # asymmetric (or mislabelled): the composition decides
    k = qweight.shape[0] * 32 // bits
    try:
        group_size = params.group_size if params.group_size is not None else gq.infer_group_size(k, n_groups, src)
        if gq.read_g_idx(tensors, k, n_groups, group_size, src) is not None:
            return None
    except FormatError:
        return None
    if group_size != -1 and (k % group_size or n_groups != k // group_size):
        return None
    if group_size not in MARLIN_GROUP_SIZES and n_groups != 1:
        return None
    n_pad, k_pad = padded_nk(n, k, group_size if n_groups > 1 else -1)
    g_eff = k if group_size == -1 else group_size
    n_groups_pad = n_groups if n_groups == 1 else n_groups + (k_pad - k) // g_eff
    words = qweight
    if (n_pad, k_pad) != (n, k):
        # Padding in word space: a word of midpoints is a row/column of codes that decode to 0.
        words = torch.full((k_pad * bits // 32, n_pad), _sym_word(bits, mid), dtype=torch.int32)
        words[: qweight.shape[0], :n] = qweight
    b_shape = (k_pad // mp.TILE, n_pad * mp.TILE * bits // 32)
    target = None
    if out is not None and out.dtype == torch.int32 and out.is_contiguous() and \
            out.numel() >= b_shape[0] * b_shape[1]:
        target = out.view(-1)[: b_shape[0] * b_shape[1]].view(b_shape)
    res = {"qweight": mp.gptq_to_b(words, bits, out=target)}
    s = _pad2(scales, n_groups_pad, n_pad, 0)
    res["scales"] = mp.permute_scales(s, n_groups_pad == 1).contiguous()
    res["shape"] = torch.tensor([n, k], dtype=torch.int64)
    return res


def to_gptq(tensors: dict[str, torch.Tensor], params: QuantScheme, src: str = "marlin", dst: str = "gptq", *,
            out: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
    """marlin -> gptq / gptq_v2 for symmetric weights without act-order, moving packed bytes only.

    Returns exactly `get_format(dst).pack(Marlin().unpack(tensors, params))`, or None when this path does not
    apply (zero points, act-order, shapes GPTQ cannot pack) — the caller then composes.
    out: optional reusable int32 buffer, as in from_gptq (used when no padding is to be cut off).
    """
    if src != "marlin" or dst not in ("gptq", "gptq_v2") or any(t in tensors for t in ("qzeros", "perm", "g_idx")):
        return None
    try:
        lay = read_layout(tensors, params)
    except FormatError:
        return None
    bits, n, k = lay.bits, lay.n, lay.k
    row = get_format(dst).spec
    if k % row.in_multiple.get(bits, 1) or n % row.out_multiple.get(bits, 1) or (lay.group_size != -1 and k % lay.group_size):
        return None
    shape = (lay.k_pad * bits // 32, lay.n_pad)
    target = None
    if (lay.n_pad, lay.k_pad) == (n, k) and out is not None and out.dtype == torch.int32 and out.is_contiguous() \
            and out.numel() >= shape[0] * shape[1]:
        target = out.view(-1)[: shape[0] * shape[1]].view(shape)
    words = mp.b_to_gptq(lay.B, bits, lay.k_pad, lay.n_pad, out=target)
    if (lay.n_pad, lay.k_pad) != (n, k):
        words = words[: k * bits // 32, :n]
    mid = 1 << (bits - 1)
    stored = mid - 1 if dst == "gptq" else mid
    s = mp.unpermute_scales(lay.scales, lay.channelwise)[: lay.n_groups, :n]
    return {
        "qweight": words.contiguous(),
        "qzeros": torch.full((lay.n_groups, n * bits // 32), _sym_word(bits, stored), dtype=torch.int32),
        "scales": s.contiguous(),
        "g_idx": (torch.arange(k, dtype=torch.int32) // lay.g_eff).to(torch.int32),
    }


# (source format, target format) -> direct function(tensors, params, src, dst) -> dict | None.
# A None result means "compose instead"; a dict is byte-identical to the composition (tests say so).
FAST_PATHS = {
    ("gptq", "marlin"): from_gptq,
    ("gptq_v2", "marlin"): from_gptq,
    ("marlin", "gptq"): to_gptq,
    ("marlin", "gptq_v2"): to_gptq,
}
