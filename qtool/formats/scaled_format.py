"""What every layout over `ScaledPlain` shares: the row of what it stores, and `adapt`, the exactness rule.

A scaled format's row says which code elements, scale strategies and stored scale types it holds, and in
which dtype its readers form the product (`compute`: "fp32", or "scale" = the scale's own dtype, as
compressed-tensors does). `adapt(p)` re-expresses a ScaledPlain in the layout's conventions without changing
one dequantized value, or says why it cannot:

- codes and the block grid must be the same (a block grid is a rename only when it is the same grid);
- a scale may change its stored type only when every value survives (bf16/fp16 -> fp32 always; fp32 -> bf16
  when each value is a bf16 value, which the data decides);
- the compute dtype may change only when both arithmetics give the same value in the output dtype: the same
  dtype, or scales that are values of the narrower dtype with the narrower dtype being the output's. Then
  the product code * scale (at most 4 + 11 significant bits) is exact in fp32, so rounding it once to the
  output dtype is what the narrow product gives too.
"""

from __future__ import annotations

from typing import ClassVar

from qtool.errors import NotRepresentable
from qtool.formats.base import Format
from qtool.formats.scaled import SCALE_TYPES, ScaledPlain, decode_scales, strategy_of

_LINEAR = ("fp32", "bf16", "fp16")
_TYPE_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class ScaledFormat(Format):
    """A layout whose canonical form is ScaledPlain. Subclasses set the row below and pack/unpack."""

    canonical: ClassVar[str] = "scaled"
    elements: ClassVar[tuple[str, ...]] = ("e4m3",)
    strategies: ClassVar[tuple[str, ...]] = ("tensor", "channel", "block", "group")
    scale_types: ClassVar[tuple[str, ...]] = ("fp32",)
    compute: ClassVar[str] = "fp32"  # "fp32" or "scale"
    zeros: ClassVar[bool] = False
    # what quantizing a dense weight for this layout uses when nothing else is asked: (element, block)
    default_block: ClassVar[tuple[int, int]] = (1, -1)

    def compute_for(self, scale_type: str) -> str:
        """The torch dtype name this layout's readers form the product in, for scales of `scale_type`."""
        if self.compute == "fp32" or scale_type not in _TYPE_OF.values():
            return "float32"
        return SCALE_TYPES[scale_type].storage

    def adapt(self, p: ScaledPlain) -> tuple[ScaledPlain | None, list[str]]:
        """(p in this layout's conventions, []) when it stores p exactly, else (None, reasons)."""
        import torch

        fid = self.spec.id
        why = []
        if p.element not in self.elements:
            why.append(f"{fid} stores {'/'.join(self.elements)} codes, not {p.element}")
        if p.strategy not in self.strategies:
            why.append(f"{fid} stores {' or '.join(self.strategies)} scales, not {p.strategy} ones")
        if p.zeros is not None and not self.zeros:
            why.append(f"{fid} is symmetric-only but the weight has zero points")
        if p.global_scale is not None:
            why.append(f"{fid} has no global scale")
        if why:
            return None, why
        st = p.scale_type if p.scale_type in self.scale_types else None
        s = p.scales
        if st is None:
            values = decode_scales(p.scales, p.scale_type).to(torch.float32)
            for cand in self.scale_types:
                if cand not in _LINEAR:
                    continue
                conv = values.to(getattr(torch, SCALE_TYPES[cand].storage))
                back = conv.to(torch.float32)
                if bool(((back == values) | (back.isnan() & values.isnan())).all()):
                    st, s = cand, conv
                    break
            if st is None:
                return None, [f"{fid} stores {'/'.join(self.scale_types)} scales; these {p.scale_type} scales "
                              f"are not all values of those types"]
        compute = self.compute_for(st)
        if compute != p.compute and not self._same_result(p, s, st, compute):
            return None, [f"{fid} forms the product in {compute} but the source in {p.compute}, and the "
                          f"results differ in {p.out_dtype}"]
        return p.with_(scales=s, scale_type=st, compute=compute), []

    @staticmethod
    def _same_result(p: ScaledPlain, s, st: str, compute: str) -> bool:
        import torch

        narrow = [c for c in (p.compute, compute) if c != "float32"]
        if len(narrow) != 1 or narrow[0] != p.out_dtype:
            return False
        values = decode_scales(s, st).to(torch.float32)
        return torch.equal(values.to(getattr(torch, narrow[0])).to(torch.float32), values)

    def check(self, plain) -> list[str]:
        """Reasons a ScaledPlain cannot be stored exactly ([] = it can). An integer `Plain` stand-in (a
        header question about a dense weight's shape) fits any shape: scaled layouts tile ragged edges."""
        if not isinstance(plain, ScaledPlain):
            return []
        return self.adapt(plain)[1]

    def require(self, plain: ScaledPlain) -> ScaledPlain:
        q, why = self.adapt(plain)
        if q is None:
            raise NotRepresentable(f"cannot store this weight as {self.spec.id}: " + "; ".join(why))
        return q


def module_meta(p: ScaledPlain) -> dict:
    """What a config writer needs of one packed module (ModulePlan.target_meta): strategy, block, scale and
    code types, the activation scheme."""
    return {"strategy": p.strategy, "block": list(p.block), "scale_type": p.scale_type, "element": p.element,
            "zeros": p.zeros is not None, "act_dynamic": bool(p.meta.get("act_dynamic", True)),
            "act_strategy": p.meta.get("act_strategy"), "act_group_size": p.meta.get("act_group_size")}


def block_of(strategy: str, o: int, i: int, block: tuple[int, int] | None = None,
             group: int | None = None) -> tuple[int, int]:
    """The (bo, bi) of a named strategy ('block' needs `block`, 'group' needs `group`)."""
    if strategy == "tensor":
        return (-1, -1)
    if strategy == "channel":
        return (1, -1)
    if strategy == "group":
        return (1, int(group))
    return (int(block[0]), int(block[1]))


def infer_block(o: int, i: int, grid: tuple[int, ...]) -> tuple[int, int] | None:
    """The block of a scale tensor's shape when the shape alone says it (None: ambiguous or impossible)."""
    n = 1
    for d in grid:
        n *= d
    if n == 1:
        return (-1, -1)
    if tuple(grid) in ((o, 1), (o,)):
        return (1, -1)
    if len(grid) != 2:
        return None
    r, c = grid
    if r == o and c and i % c == 0:
        return (1, i // c)
    for b in (128, 64, 256, 32, 512, 16):
        if -(-o // b) == r and -(-i // b) == c:
            return (b, b)
    return None


__all__ = ["ScaledFormat", "block_of", "infer_block", "module_meta", "strategy_of"]
