"""`qtool validate`: prove a checkpoint, and the kernels that read it, are right.

    from qtool.validate import ValidateOptions, validate_path
    report = validate_path("model-gptq/", ValidateOptions(reference=Path("model-dense/")))
    report.status, report.to_dict()          # pass, fail or skip (nothing checked); the --json schema

Checks (qtool.report.validate.CHECKS): integrity (inspect --deep's checks, shards and index), roundtrip
(unpack -> pack gives the stored bytes), contract (config keys the engines read; a kernel for every layer),
reference (error against the dense source within bounds from bits and group size), kernels (every eligible
kernel against the float64 oracle), hashes (per tensor and per model, shard-layout independent).
"""

from qtool.validate.core import DEFAULT_BATCH_SIZES, ValidateOptions, validate_path

__all__ = ["DEFAULT_BATCH_SIZES", "ValidateOptions", "validate_path"]
