"""`inspect --deep` for gpt-oss MXFP4 expert stacks (`<name>_blocks` [E, O, I/32, 16] / `<name>_scales`
[E, O, I/32]): E weights under one name, which no 2-D ScaledPlain holds, so they are decoded here with the
format's block decoder. Anomalies: an E8M0 byte 0xFF (NaN), and a byte of 254 or more (the largest E2M1
code times 2^127 overflows bf16: scale overflow). Every 2-D micro-float layout goes through its format's
unpack and the ScaledPlain anomalies (inspect/deep.py, _deep_scaled).
"""

from __future__ import annotations


def deep_micro(m, t: dict, notes: list, check_weight, stats: bool = True) -> None:
    """Check one gpt-oss expert module (`m` a ModuleReport, `t` {short name: tensor}); findings appended to
    `notes`; `check_weight(w, module, notes)` gives the statistics of a dequantized weight (inspect.deep's)."""
    import torch

    from qtool.formats.mxfp import decode_blocks
    from qtool.packing.minifloat import E8M0_NAN

    values = []
    for name in sorted(k[: -len("_blocks")] for k in t if k.endswith("_blocks")):
        s = t[f"{name}_scales"].view(torch.uint8)
        nan = int((s == E8M0_NAN).sum())
        if nan:
            notes.append(("error", m.name, f"{nan} e8m0 scale(s) of {name} are 0xFF (NaN)"))
        top = int(s[s != E8M0_NAN].max()) if int((s != E8M0_NAN).sum()) else 0
        if top >= 254:
            notes.append(("error", m.name, f"{name}: e8m0 scale byte {top} overflows bf16 with the largest code "
                                           "(scale overflow)"))
        values.append(decode_blocks(t[f"{name}_blocks"], s, torch.float32).reshape(-1))
    if stats and values:
        m.stats = check_weight(torch.cat(values), m.name, notes)
    return None
