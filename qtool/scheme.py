"""One record for "how a module is quantized", shared by every layer (no torch, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class QuantScheme:
    """How one linear module is (or is to be) quantized. A field is None where nothing says.

    format:     qtool format id ("gptq", "gptq_v2", "awq", "ct", "marlin", "gguf_q4_0", ...) or a detected
                foreign layout ("fp8", "gguf:Q4_K", ...)
    bits:       code width; group_size: inputs per scale (-1 = one group over all inputs)
    sym:        every zero is the midpoint 2^(bits-1); desc_act: an act-order g_idx (arbitrary group map)
    convention: a format's reading convention where the bytes alone cannot tell (GPTQ v1 zeros: "word",
                GPTQModel's whole-word add and the default, or "field", per-field z - 1)
    extra:      format-specific facts a reader needs (compressed-tensors "packing"/"version", Marlin
                "marlin.source", GGUF "gguf_type")
    """

    format: str | None = None
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    desc_act: bool | None = None
    convention: str | None = None
    extra: dict = field(default_factory=dict, compare=False)
