"""`inspect --deep` for the micro-float layouts (NVFP4, MXFP4, MXFP8, gpt-oss MXFP4): decode through the
format's own `unpack` into ScaledPlain, report its anomalies, and the dequantized weight's statistics.

Anomalies (ScaledPlain.anomalies, plus the E8M0 range here): an E8M0 scale byte 0xFF (NaN), a scale that
overflows the output dtype with the largest code, a global scale of 0 / NaN / inf, zero or negative block
scales, E4M3 weight codes with NaN bit patterns. Zero block scales are warnings (their block reads 0);
everything else is an error.
"""

from __future__ import annotations

MICRO_FLOAT = ("nvfp4", "modelopt_nvfp4", "mxfp4", "mxfp8", "gptoss_mxfp4")


def _severity(msg: str) -> str:
    return "warning" if msg.endswith("are zero") else "error"


def deep_micro(m, t: dict, notes: list, check_weight, stats: bool = True) -> None:
    """Check one module (`m` a ModuleReport, `t` {short name: tensor}); findings appended to `notes`;
    `check_weight(w, module, notes)` gives the statistics of a dequantized weight (inspect.deep's)."""
    import torch

    from qtool.formats.base import get_format
    from qtool.formats.mxfp import decode_blocks
    from qtool.formats.scaled import dequantize
    from qtool.packing.minifloat import E8M0_NAN

    if m.scheme.format == "gptoss_mxfp4" and "weight_blocks" not in t:
        values = []
        for name in sorted(k[: -len("_blocks")] for k in t if k.endswith("_blocks")):
            s = t[f"{name}_scales"].view(torch.uint8)
            nan = int((s == E8M0_NAN).sum())
            if nan:
                notes.append(("error", m.name, f"{nan} e8m0 scale(s) of {name} are 0xFF (NaN)"))
            # 6 * 2^(e - 127) beyond bf16's range: e >= 254 overflows with the largest code
            top = int(s.max()) if s.numel() else 0
            if top >= 254:
                notes.append(("error", m.name, f"{name}: e8m0 scale byte {top} overflows bf16 with the largest "
                                               "code (scale overflow)"))
            values.append(decode_blocks(t[f"{name}_blocks"], s, torch.float32).reshape(-1))
        if stats and values:
            m.stats = check_weight(torch.cat(values), m.name, notes)
        return None
    p = get_format(m.scheme.format).unpack(t)
    for msg in p.anomalies():
        notes.append((_severity(msg), m.name, msg))
    if stats:
        m.stats = check_weight(dequantize(p), m.name, notes)
    return None
