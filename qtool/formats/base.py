"""A format is a spec row (data) plus pure functions over tensor dicts and tensor signatures.

    pack(Plain) -> dict[str, Tensor]          the tensors of ONE linear module, short names
                                              ("qweight", "qzeros", "scales", "g_idx", ...)
    unpack(dict[str, Tensor], QuantScheme) -> Plain
    detect(module, {short name: Sig}, Claims) -> Detected | None
                                              recognition from a header alone (detection.py)

Formats do no file I/O and know nothing of kernels or devices. Module prefixes ("model.layers.0.mlp.up_proj.")
are added and stripped by the I/O layer. `check(plain)` says, before anything is written, why a Plain cannot be
stored exactly (empty list = it can).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from qtool.errors import FormatError, UsageError
from qtool.formats.detection import Claims, Detected, Sig
from qtool.formats.plain import Plain
from qtool.lazy import lazy_module
from qtool.scheme import QuantScheme

torch = lazy_module("torch")


@dataclass(frozen=True)
class FormatSpec:
    """One row of the format table: what `check()`, the registry and the documentation read.

    id:          stable identifier used on the command line and in metadata ("gptq", "gptq_v2", ...)
    aliases:     other spellings that name this format (repack targets, inspect's type names); one table
    bits:        bit widths the layout can hold
    tensors:     short tensor names the layout writes (optional ones included); repack carries others aside
    required:    short tensor names every module of the layout holds
    summary:     one line on the packed shapes, for documentation
    group_sizes: allowed group sizes; None = any positive size dividing in_features, plus -1
    sym / asym:  whether symmetric / asymmetric zeros can be stored
    act_order:   whether an arbitrary g_idx can be stored
    in_multiple / out_multiple: bits -> the multiple of in_features / out_features the packing needs
                 (a word holds whole runs of codes); a width not listed needs none
    """

    id: str
    bits: tuple[int, ...]
    tensors: tuple[str, ...]
    required: tuple[str, ...]
    summary: str
    aliases: tuple[str, ...] = ()
    group_sizes: tuple[int, ...] | None = None
    sym: bool = True
    asym: bool = True
    act_order: bool = False
    in_multiple: Mapping[int, int] = field(default_factory=dict)
    out_multiple: Mapping[int, int] = field(default_factory=dict)


class Format:
    """Subclass per layout; set `spec`; implement `pack`, `unpack`, `detect`; override `check` for extra
    limits."""

    spec: ClassVar[FormatSpec]

    def pack(self, plain: Plain) -> dict[str, torch.Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme) -> Plain:  # pragma: no cover
        raise NotImplementedError

    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        """This layout as read from one module's tensor signatures and the claims (see detection.py), or None
        when the tensors are not this layout. Header only: no tensor data, no torch."""
        return None

    def check(self, plain: Plain) -> list[str]:
        """Reasons this Plain cannot be stored exactly; [] when it can: the spec row's rules, in its order."""
        s = self.spec
        why = []
        if plain.bits not in s.bits:
            why.append(f"{s.id} holds {', '.join(map(str, s.bits))}-bit codes, not {plain.bits}-bit")
        if s.group_sizes is not None and plain.group_size not in s.group_sizes:
            why.append(f"{s.id} group sizes are {list(s.group_sizes)}, not {plain.group_size}")
        if plain.group_size != -1 and plain.in_features % plain.group_size:
            why.append(f"group_size {plain.group_size} does not divide in_features {plain.in_features}")
        if not s.act_order and plain.desc_act:
            why.append(f"{s.id} has no g_idx: act-order (desc_act) cannot be stored")
        if not s.asym and not plain.sym:
            why.append(f"{s.id} is symmetric-only but the zero points vary")
        m_in, m_out = s.in_multiple.get(plain.bits, 1), s.out_multiple.get(plain.bits, 1)
        if plain.in_features % m_in:
            why.append(f"{s.id} {plain.bits}-bit packs in_features in runs of {m_in}, but in_features is "
                       f"{plain.in_features}")
        if plain.out_features % m_out:
            why.append(f"{s.id} {plain.bits}-bit packs zeros along out_features in runs of {m_out}, but "
                       f"out_features is {plain.out_features}")
        return why

    def quantization_config(self, modules: Sequence[tuple[str, QuantScheme, dict | None]],
                            dense: Sequence[str] | None = None) -> dict | None:
        """config.json `quantization_config` the engines read for a checkpoint of this layout, from its
        converted modules: (module name, scheme written, the module's `module_meta` or None), and `dense`, the
        linear modules kept unquantized, which the config must exclude (loaders would look for their packed
        tensors). A pure dict (io writes it); None when the layout's container carries no such config
        (GGUF)."""
        return None

    def require(self, plain: Plain) -> None:
        why = self.check(plain)
        if why:
            raise FormatError("; ".join(why))


# Filled by @register as the layout modules load. qtool/formats/__init__.py imports every one of them, and
# Python runs a package's __init__ before any of its modules, so the registry is complete whenever code
# outside the package can reach this module.
_REGISTRY: dict[str, Format] = {}
# Every spelling of every format (id and the row's aliases, normalized by _key) -> its id.
_IDS: dict[str, str] = {}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def register(cls: type[Format]) -> type[Format]:
    """Class decorator: one instance per format id; its row's aliases name it too."""
    spec = cls.spec
    _REGISTRY[spec.id] = cls()
    for name in (spec.id, *spec.aliases):
        if _IDS.setdefault(_key(name), spec.id) != spec.id:
            raise RuntimeError(f"format alias '{name}' of {spec.id} already names {_IDS[_key(name)]}")
    return cls


def format_id(name: str) -> str | None:
    """The format id a name spells (its id or one of its row's aliases, any case, '-' for '_'); None when
    no format has that name."""
    return _IDS.get(_key(name))


def get_format(name: str) -> Format:
    fid = format_id(name)
    if fid is None:
        known = ", ".join(sorted(_REGISTRY))
        raise UsageError(f"unknown format '{name}'", fix=f"choose one of: {known}")
    return _REGISTRY[fid]


def all_formats() -> dict[str, Format]:
    return dict(_REGISTRY)


def bits_text(bits: Sequence[int]) -> str:
    """(2, 3, 4, 5, 6, 7, 8) -> "2-8"; (2, 3, 4, 8) -> "2, 3, 4, 8"."""
    b = sorted(bits)
    if len(b) > 2 and b == list(range(b[0], b[-1] + 1)):
        return f"{b[0]}-{b[-1]}"
    return ", ".join(map(str, b))


def format_names(ids: Sequence[str] | None = None, *, aliases: bool = True) -> str:
    """The formats a command accepts, for its help and errors, read from the rows: "gguf_q4_0 (q4_0), gptq
    (gptq_v1), ...". Every registered format (sorted by id) unless `ids` names them; `aliases=False` for a
    command that takes ids only. Aliases with ':' (inspect's GGUF type names) are not command-line spellings
    and are left out."""
    out = []
    for fid in ids if ids is not None else sorted(_REGISTRY):
        also = [a for a in _REGISTRY[fid].spec.aliases if ":" not in a] if aliases else []
        out.append(f"{fid} ({', '.join(also)})" if also else fid)
    return ", ".join(out)


def expect(tensors: dict[str, torch.Tensor], name: str, fmt: str, *, dtype: torch.dtype | None = None,
           dims: int | None = None) -> torch.Tensor:
    """Fetch a tensor a layout needs, with an error that names it."""
    if name not in tensors:
        raise FormatError(f"{fmt}: missing tensor '{name}' (have {sorted(tensors)})", tensor=name)
    t = tensors[name]
    if dtype is not None and t.dtype != dtype:
        raise FormatError(f"{fmt}: '{name}' must be {dtype}, got {t.dtype}", tensor=name)
    if dims is not None and t.dim() != dims:
        raise FormatError(f"{fmt}: '{name}' must be {dims}-D, got shape {tuple(t.shape)}", tensor=name)
    return t
