"""`validate_path`: every check, one module at a time, in one read of the data.

Per module the tensors are read once; their bytes are hashed, the integrity checks of `inspect --deep` run
on them (qtool.inspect.deep.deep_module: the same code), and the decoded Plain feeds the round trip, the
reference comparison and (once per distinct layer shape) the kernels. Nothing of a module is kept after it,
so memory follows the largest module, not the model. Tensors outside every module (embeddings, norms) are
read and hashed too: integrity covers every tensor.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qtool.errors import InputError, UsageError
from qtool.report.validate import CHECKS, NO_REFERENCE, CheckResult, ValidateReport
from qtool.validate import numeric
from qtool.validate.hashing import ALGORITHM, Hasher, compare, model_digest

DEFAULT_BATCH_SIZES = (1, 7, 32)
DATA_CHECKS = frozenset({"integrity", "roundtrip", "reference", "kernels", "hashes"})
NEEDS_PLAIN = frozenset({"roundtrip", "reference", "kernels"})
ABSENT = "not in the reference"
# Tensors read but not yet hashed (the hash pool runs behind the reader by at most this much).
PENDING_BYTES = 1 << 30


class _Buffers:
    """Read buffers that come back once their tensor is checked and hashed.

    A fresh buffer per tensor costs a page fault and a kernel zero-fill per 4 KiB page, about as much CPU as
    the read itself; a checkpoint's tensors repeat a few sizes, so a returned buffer nearly always fits the
    next tensor of its kind. At most `keep` bytes wait in the free list."""

    def __init__(self, keep: int = PENDING_BYTES):
        self.free: list = []
        self.keep = keep

    def take(self, nbytes: int):
        import numpy as np

        fits = [i for i, b in enumerate(self.free) if nbytes <= len(b) <= 2 * nbytes]
        if fits:
            return self.free.pop(min(fits, key=lambda i: len(self.free[i])))
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf) -> None:
        self.free.append(buf)
        while sum(len(b) for b in self.free) > self.keep:
            self.free.pop(max(range(len(self.free)), key=lambda i: len(self.free[i])))


@dataclass(frozen=True)
class ValidateOptions:
    """checks: which of CHECKS run; reference: the dense checkpoint the file was made from (the reference
    check is skipped without it); device: where kernels run ("cpu", "cuda", "cuda:N"; None = cuda when
    present); kernels: only these kernel ids (None = every registered one); batch_sizes: the M the kernels
    run at; engines / targets: what the contract check asks `select` about (targets: device profiles, or cpu
    / cuda:N); against: a second checkpoint whose tensors are compared by hash."""

    checks: tuple[str, ...] = CHECKS
    reference: Path | None = None
    device: str | None = None
    kernels: tuple[str, ...] | None = None
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    engines: tuple[str, ...] = ()  # () = each layer by whichever of contract.DEFAULT_ENGINES runs it
    targets: tuple[str, ...] = ()
    against: Path | None = None

    def check(self) -> None:
        bad = [c for c in self.checks if c not in CHECKS]
        if bad or not self.checks:
            raise UsageError(f"--checks {','.join(bad) or '(empty)'}: unknown check",
                             fix=f"choose among {', '.join(CHECKS)}")
        if not self.batch_sizes or any(m < 1 for m in self.batch_sizes):
            raise UsageError("--batch-sizes must be positive integers", fix="e.g. --batch-sizes 1 16 64")
        for flag, p in (("--reference", self.reference), ("--against", self.against)):
            if p is not None and not Path(p).exists():
                raise InputError(f"{flag}: no such file or directory", path=p, fix="check the path")
        if self.device is not None:  # a device that is not there is bad input, never a failed check
            from qtool.errors import DeviceError
            from qtool.kernels.devices import torch_device

            try:
                torch_device(self.device)
            except DeviceError as e:
                raise UsageError(f"--device {self.device}: {e.problem}",
                                 fix="use cpu, cuda or cuda:N of this machine; --target PROFILE plans the "
                                     "contract for a device profile (h100, a100, ...)") from None


def validate_path(path: str | Path, opt: ValidateOptions | None = None,
                  on_progress: Callable[[int, int], None] | None = None) -> ValidateReport:
    opt = opt or ValidateOptions()
    opt.check()
    if opt.against is not None and "hashes" not in opt.checks:  # the comparison is of the content hashes
        opt = replace(opt, checks=(*opt.checks, "hashes"))
    t0 = time.perf_counter()
    run = _Run(Path(path), opt)
    threads = run.share_cores()
    try:
        run.go(on_progress)
    finally:
        run.close()
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
    if opt.against is not None:
        _against(run.report, opt)
    run.report.seconds = time.perf_counter() - t0
    return run.report


def _against(report: ValidateReport, opt: ValidateOptions) -> None:
    other = validate_path(opt.against, ValidateOptions(checks=("hashes",)))
    differ, only_a, only_b = compare(report.tensor_hashes, other.tensor_hashes)
    for name in differ:
        report.checks.append(CheckResult("hashes", name, "fail", f"content differs from {opt.against}"))
    for name in only_a:
        report.checks.append(CheckResult("hashes", name, "fail", f"not in {opt.against}"))
    for name in only_b:
        report.checks.append(CheckResult("hashes", name, "fail", f"only in {opt.against}"))
    if not (differ or only_a or only_b):
        report.checks.append(CheckResult("hashes", None, "pass", f"every tensor equals {opt.against}'s "
                                                                 f"({len(report.tensor_hashes)} tensors)"))


class _Run:
    def __init__(self, path: Path, opt: ValidateOptions):
        from qtool.inspect.core import finish_report, open_inspected

        self.path, self.opt = path, opt
        self.on = set(opt.checks)
        self.header, self.handle, self.claims = open_inspected(path)
        finish_report(self.header)
        self.gguf = self.header.container == "gguf"
        self.device = self._device() if "kernels" in self.on else None
        self.report = ValidateReport(path=str(path), device=str(self.device or opt.device or "cpu"),
                                     hash_algorithm=ALGORITHM if "hashes" in self.on else "",
                                     selected=tuple(c for c in CHECKS if c in self.on))
        self.hasher = Hasher() if "hashes" in self.on else None
        self.ref = None
        self.kernel_keys: set[tuple] = set()
        self.buffers = _Buffers()
        self.held: list = []  # (name, buffer, nbytes) read for the module being checked
        self.pending: list = []  # (name, digest function, buffer, nbytes) waiting for the hash pool
        self.pending_bytes = 0
        self.warnings: list[tuple[str, str, str]] = []

    def share_cores(self) -> int | None:
        """While the hash pool runs, torch's own thread pool gets the cores the pool leaves (at least one):
        its workers spin while they wait for work, and on a small machine that spinning takes the CPU the
        hashes need. Returns torch's previous thread count, to restore; None when nothing changed."""
        if self.hasher is None:
            return None
        import os

        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - self.hasher.workers))
        return before

    def _device(self):
        from qtool.kernels.devices import torch_device

        return torch_device(self.opt.device)

    def add(self, name: str, module: str | None, status: str, detail: str = "", numbers: dict | None = None):
        if name in self.on:
            self.report.checks.append(CheckResult(name, module, status, detail, numbers or {}))

    def close(self) -> None:
        if self.hasher is not None:
            self.hasher.close()
        if not self.gguf:
            self.handle.close()

    # --- the walk --------------------------------------------------------------------------------------
    def go(self, on_progress) -> None:
        rep = self.report
        self._file_level()
        if "contract" in self.on:
            from qtool.validate import contract

            raw = None if self.gguf else self.handle.quant_raw
            targets = self.opt.targets or (self._contract_target(),)
            rep.checks += contract.check(self.header, raw, self.path, self.opt.engines, targets)
        if "reference" in self.on:
            self._open_reference()
        modules = self.header.modules
        in_module = {n for m in modules for n in m.tensor_names}
        others = [t for t in self.header.tensors if t.name not in in_module]
        if not self.on & DATA_CHECKS:  # the contract alone reads headers and configs only
            modules, others = [], []
        if "kernels" in self.on:
            self._check_memory(modules)
        total = len(modules) + (1 if others else 0)
        for k, m in enumerate(modules):
            self._module(m)
            self._settle()
            self._drain(PENDING_BYTES)
            if on_progress:
                on_progress(k + 1, total)
        if others:
            self._others([t.name for t in others])
            if on_progress:
                on_progress(total, total)
        self._drain()
        from qtool.inspect.report import merge_notes

        rep.notes += [f"{a.tensor + ': ' if a.tensor else ''}{a.message}" for a in merge_notes(self.warnings)]
        rep.modules = len(self.header.modules)
        rep.tensors = self.header.tensor_count
        if self.hasher is not None:
            self._model_hash()
        for name in ("roundtrip", "reference", "kernels"):
            if name in self.on and not any(c.name == name for c in rep.checks):
                self.add(name, None, "skip", "no quantized module qtool decodes")

    def _model_hash(self) -> None:
        """The model hash only over the whole model: a tensor that a header or the index names but that could
        not be read leaves it unset, and the check fails naming how many."""
        rep = self.report
        expected = {t.name for t in self.header.tensors}
        if not self.gguf and self.handle.index is not None:
            expected |= set(self.handle.index.get("weight_map", {}))
        missing = sorted(expected - rep.tensor_hashes.keys())
        if missing:
            self.add("hashes", None, "fail", f"{len(missing)} of {len(expected)} tensors could not be read "
                                             f"(e.g. '{missing[0]}'): no model hash for an incomplete model",
                     {"tensors": len(rep.tensor_hashes), "missing": len(missing)})
            return
        rep.model_hash = model_digest(rep.tensor_hashes)
        if not any(c.name == "hashes" and c.status == "fail" for c in rep.checks):
            self.add("hashes", None, "pass", f"{len(rep.tensor_hashes)} tensors hashed; model {ALGORITHM} "
                                             f"{rep.model_hash}", {"tensors": len(rep.tensor_hashes)})

    def _check_memory(self, modules) -> None:
        """Refuse, before any module is read, kernel checks whose largest layer and M would not fit the device
        (the float64 oracle holds the layer and each M's products)."""
        from qtool.kernels.devices import device_available_bytes
        from qtool.report.common import human_bytes
        from qtool.validate.kernelcheck import need_bytes

        m = max(self.opt.batch_sizes)
        sized = [(need_bytes(x.out_features, x.in_features, m), x) for x in modules
                 if x.quantized and x.in_features and x.out_features]
        if not sized:
            return
        need, worst = max(sized, key=lambda t: t[0])
        avail, source = device_available_bytes(self.device)
        if need > avail:
            raise UsageError(f"the kernels check of {worst.name} ([{worst.out_features}, {worst.in_features}]) at "
                             f"--batch-sizes {m} needs about {human_bytes(need)} on {self.device}, more than the "
                             f"{human_bytes(avail)} {source}",
                             fix="give smaller --batch-sizes, or leave kernels out of --checks")

    def _contract_target(self) -> str:
        if self.device is not None:
            return str(self.device)
        return self.opt.device or "cpu"

    # --- file level --------------------------------------------------------------------------------------
    def _file_level(self) -> None:
        """The header findings of inspect (shards, index, truncation, configs against each other and the
        tensors), and shards no index names."""
        errors = 0
        for a in self.header.anomalies:
            if a.severity == "error":
                self.add("integrity", a.tensor, "fail", a.message)
                errors += 1
            elif a.severity == "warning":
                self.warnings.append(("warning", a.tensor or "", a.message))
        errors += self._configs_agree()
        if not self.gguf and self.handle.index is not None:
            named = set(self.handle.index.get("weight_map", {}).values())
            for f in sorted(self.handle.root.glob("*.safetensors")):
                if f.name not in named:
                    self.add("integrity", None, "fail", f"shard {f.name} is not named by the index (orphaned): "
                                                        "loaders never read it; fix: add its tensors to the index "
                                                        "or delete it")
                    errors += 1
        if not errors:
            what = "index, " if not self.gguf and self.handle.index is not None else ""
            self.add("integrity", None, "pass", f"headers of {len(self.header.files)} file(s), {what}configs and "
                                                "tensor shapes consistent")

    def _configs_agree(self) -> int:
        """config.json's quantization_config and quantize_config.json must say the same: engines differ in which
        they read (inspect warns; a CI gate fails)."""
        if self.gguf or not isinstance(self.handle.config, dict):
            return 0
        a = self.handle.config.get("quantization_config")
        qc = self.handle.root / "quantize_config.json"
        if not isinstance(a, dict) or not qc.is_file():
            return 0
        from qtool.errors import InputError
        from qtool.inspect.sources import config_disagreements
        from qtool.io.checkpoint import read_json

        try:
            b = read_json(qc)
        except InputError:
            return 0  # inspect reported it as an error already
        bad = config_disagreements(a, b) if isinstance(b, dict) else []
        for k, va, vb in bad:
            self.add("integrity", None, "fail", f"config.json says {k}={va!r} but quantize_config.json says {vb!r}: "
                                                "engines disagree on which file wins; fix: make them agree")
        return len(bad)

    def _open_reference(self) -> None:
        if self.opt.reference is None:
            self.add("reference", None, "skip", NO_REFERENCE)
            return
        from qtool.io.checkpoint import open_checkpoint

        self.ref = open_checkpoint(self.opt.reference)

    # --- data --------------------------------------------------------------------------------------------
    def _read(self, name: str) -> Any | None:
        """One tensor: torch for safetensors, raw uint8 [rows, row_bytes] for GGUF; hashed on the way.
        None (and an integrity failure) when it cannot be read."""
        import torch

        from qtool.errors import QtoolError

        buf = None
        try:
            if self.gguf:
                t, dtype, shape, raw, buf = self._read_gguf(name)
            else:
                from qtool.io.checkpoint import read_tensor

                info = self.handle.tensors[name]
                buf = self.buffers.take(info.nbytes) if info.nbytes else None
                t = read_tensor(info, into=buf)
                dtype, shape = info.dtype, info.shape
                raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        except QtoolError as e:
            if buf is not None:
                self.buffers.give(buf)
            self.add("integrity", name, "fail", f"unreadable: {e.problem}")
            self.add("hashes", name, "fail", "unreadable: not hashed")
            return None
        self.report.bytes_read += len(raw)
        if self.hasher is not None:
            # hashed on the pool while the next tensors are read and checked; bounded by PENDING_BYTES
            self.pending.append((name, self.hasher.submit(dtype, shape, raw), buf, len(raw)))
            self.pending_bytes += len(raw)
        elif buf is not None:
            self.held.append(buf)
        return t

    def _settle(self) -> None:
        """The module's tensors are checked: buffers not waiting for a hash go back for reuse."""
        for buf in self.held:
            self.buffers.give(buf)
        self.held = []

    def _drain(self, limit: int = 0) -> None:
        while self.pending and (self.pending_bytes > limit or len(self.pending) > 64):
            name, digest, buf, nbytes = self.pending.pop(0)
            self.report.tensor_hashes[name] = digest()
            self.pending_bytes -= nbytes
            if buf is not None:
                self.buffers.give(buf)

    def _read_gguf(self, name: str):
        import torch

        from qtool.errors import InputError
        from qtool.io.checkpoint import read_bytes

        t = self._gguf_tensor(name)
        if t is None or t.nbytes is None or not t.complete:
            raise InputError("tensor data is missing or truncated", path=getattr(t, "file", self.path), tensor=name)
        buf = self.buffers.take(t.nbytes) if t.nbytes else None
        try:
            raw = read_bytes(t.file, t.start, t.nbytes, name, into=buf)
        except InputError:
            if buf is not None:
                self.buffers.give(buf)
            raise
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        return torch.from_numpy(raw.reshape(rows, -1) if rows else raw), t.type_name, t.shape, raw, buf

    def _gguf_tensor(self, name: str):
        if not hasattr(self, "_by_name"):
            self._by_name = {}
            for t in self.handle.tensors:
                self._by_name.setdefault(t.name, t)
        return self._by_name.get(name)

    def _copied(self, name: str, t) -> tuple[str, str]:
        """(status, detail) of a tensor that quantizing leaves alone (a dense module, a norm, an embedding)
        against the reference: the same values, or the reference's rounded to this tensor's dtype."""
        import torch

        from qtool.errors import QtoolError

        if name not in self.ref.tensors:
            return "skip", ABSENT
        try:
            r = self.ref.get(name)
        except QtoolError as e:
            return "fail", f"reference unreadable: {e.problem}"
        if tuple(r.shape) != tuple(t.shape):
            return "fail", f"the reference's is {list(r.shape)}, this one {list(t.shape)}"
        if r.dtype == t.dtype and torch.equal(r, t):
            return "pass", "identical"
        if r.dtype != t.dtype and r.is_floating_point() and t.is_floating_point() and torch.equal(r.to(t.dtype), t):
            return "pass", f"the reference's values rounded to {str(t.dtype).removeprefix('torch.')}"
        diff = f"max |diff| {_max_diff(r, t):.3g}"
        if self._awq_folded:
            return "skip", f"differs from the reference ({diff}) as AWQ makes it: the input scales of the next " \
                           "layer are folded into it"
        return "fail", f"differs from the reference ({diff})"

    @functools.cached_property
    def _awq_folded(self) -> bool:
        """AWQ calibration folds each layer's input scales into the op before it (a norm, a linear), so those
        tensors differ from the dense model by design: qtool records the method; AutoAWQ files always fold."""
        if self.gguf:
            return False
        method = self.handle.metadata.get("qtool.method")
        if method is not None:
            return method == "awq"
        raw = self.handle.quant_raw
        return isinstance(raw, dict) and str(raw.get("quant_method", "")).lower() == "awq"

    def _others(self, names: list[str]) -> None:
        bad = 0
        same, absent, folded = 0, [], []
        for n in names:
            if (self.gguf and not getattr(self._gguf_tensor(n), "complete", False)) or \
                    (not self.gguf and n in self.handle.incomplete):
                self.add("integrity", n, "fail", "data truncated")
                bad += 1
                continue
            t = self._read(n)
            if t is None:
                bad += 1
                continue
            if not self.gguf and t.dtype.is_floating_point and t.numel():
                import torch

                if not bool(torch.isfinite(t).all()):
                    self.add("integrity", n, "fail", "has NaN/Inf values")
                    bad += 1
            if not self.gguf and self.ref is not None:
                status, detail = self._copied(n, t)
                if status == "pass":
                    same += 1
                elif status == "skip":
                    (absent if detail == ABSENT else folded).append(n)
                else:
                    self.add("reference", n, status, detail)
            del t
            self._settle()
            self._drain(PENDING_BYTES)
        if not bad:
            self.add("integrity", None, "pass", f"{len(names)} tensors outside the linear modules readable and "
                                                "complete")
        if same:
            self.add("reference", None, "pass", f"{same} tensor{'s' if same > 1 else ''} outside the linear modules, "
                                                "equal to the reference's")
        if absent:
            self.add("reference", None, "skip", f"{len(absent)} tensor{'s' if len(absent) > 1 else ''} outside the "
                                                f"linear modules not in the reference (e.g. '{absent[0]}')")
        if folded:
            self.add("reference", None, "skip", f"{len(folded)} tensor{'s' if len(folded) > 1 else ''} outside the "
                                                "linear modules differ from the reference as AWQ makes them (the "
                                                f"next layer's input scales folded in; e.g. '{folded[0]}')")

    def _module(self, m) -> None:
        from qtool.inspect.deep import deep_gguf_module, deep_module

        incomplete = [n for n in m.tensor_names if (n in self.handle.incomplete if not self.gguf else
                                                    not getattr(self._gguf_tensor(n), "complete", False))]
        if incomplete:
            self.add("integrity", m.name, "fail", f"data truncated ({', '.join(incomplete)}): module not checked")
            for c in ("roundtrip", "reference", "kernels"):
                self.add(c, m.name, "skip", "data truncated")
            return
        tensors = {}
        for n in m.tensor_names:
            t = self._read(n)
            if t is None:
                return
            tensors[n] = t
        notes: list[tuple[str, str, str]] = []
        decoded = None
        if self.gguf:
            deep_gguf_module(m, self._gguf_tensor(f"{m.name}.weight" if m.name else "weight"), notes)
            decoded = self._gguf_plain(m, tensors, notes)
        else:
            from qtool.inspect.detect import split_name

            short = {split_name(n)[1]: t for n, t in tensors.items()}
            if m.scheme.format != "unknown":
                try:
                    decoded = deep_module(m, short, self.claims, notes, self.handle, stats=False,
                                          decode=bool(self.on & NEEDS_PLAIN))
                except Exception as e:  # noqa: BLE001 - a module that cannot be decoded is a finding, not a crash
                    from qtool.errors import QtoolError

                    msg = e.problem if isinstance(e, QtoolError) else f"{type(e).__name__}: {e}"
                    notes.append(("error", m.name, f"cannot decode as {m.scheme.format}: {msg}"))
            if decoded is not None:
                decoded = (*decoded, short)
        errs = [msg for sev, _, msg in notes if sev == "error"]
        self.warnings += [(s, mod, msg) for s, mod, msg in notes if s == "warning"]
        unavailable = [msg for sev, _, msg in notes if sev == "info" and "unavailable" in msg]
        if errs:
            self.add("integrity", m.name, "fail", "; ".join(errs))
        elif m.scheme.format == "unknown":
            self.add("integrity", m.name, "skip", f"{len(tensors)} tensors readable; a layout qtool does not know: "
                                                  "values not checked")
        elif unavailable:
            self.add("integrity", m.name, "skip", f"readable; {'; '.join(unavailable)}")
        else:
            self.add("integrity", m.name, "pass", f"{m.scheme.format}: {len(tensors)} tensors readable, values in range")
        if decoded is False:
            return
        if decoded is None:
            dense = m.scheme.format == "dense"
            why = "dense module: nothing quantized" if dense else \
                f"format {m.scheme.format}: qtool has no decoder to a canonical Plain"
            for c in ("roundtrip", "kernels") if dense and self.ref is not None else \
                    ("roundtrip", "reference", "kernels"):
                self.add(c, m.name, "skip", why)
            if dense and self.ref is not None:
                for n, t in tensors.items():
                    self.add("reference", n, *self._copied(n, t))
            return
        fmt_id, _params, plain, stored = decoded
        if errs:
            for c in ("roundtrip", "reference", "kernels"):
                self.add(c, m.name, "skip", "integrity failed")
            return
        self._numeric(m, fmt_id, plain, stored)

    def _gguf_plain(self, m, tensors: dict, notes) -> tuple | bool | None:
        from qtool.formats.base import format_id, get_format
        from qtool.scheme import QuantScheme

        fmt_id = format_id(m.scheme.format)  # "gguf:Q4_0" is an alias of the block format that holds it exactly
        if fmt_id is None:
            return None
        t = self._gguf_tensor(f"{m.name}.weight" if m.name else "weight")
        if any(h.byte_order == "big" for h in self.handle.headers if h.path == t.file):
            notes.append(("info", m.name, "big-endian GGUF data: round trip and kernels unavailable"))
            return None
        stored = {"weight": tensors[t.name]}
        params = QuantScheme(format=fmt_id, bits=m.scheme.bits, group_size=32, sym=m.scheme.sym, desc_act=False,
                             extra={"gguf_type": t.type_name})
        from qtool.errors import QtoolError

        try:
            plain = get_format(fmt_id).unpack(stored, params)
        except QtoolError as e:
            # The blocks dequantized above (integrity); qtool's integer-zero canonical form cannot hold them
            # (llama.cpp's Q4_1 offsets are free floats), so the checks that need a Plain cannot run.
            self.report.checks += [CheckResult(c, m.name, "skip", f"{fmt_id}: {e.problem}")
                                   for c in ("roundtrip", "reference", "kernels") if c in self.on]
            return False
        return fmt_id, params, plain, stored

    def _numeric(self, m, fmt_id: str, plain, stored: dict) -> None:
        from qtool.formats.base import get_format

        if "roundtrip" in self.on:
            self.add("roundtrip", m.name, *numeric.round_trip(get_format(fmt_id), plain, stored))
        if "reference" in self.on and self.ref is not None:
            name = f"{m.name}.weight" if m.name else "weight"
            if self.gguf:  # llama.cpp's tensor names (blk.N.attn_q) are not the reference's
                self.add("reference", m.name, "skip", "a GGUF module: its names are not the reference's")
            elif self._awq_folded:
                self.add("reference", m.name, "skip", "AWQ scales this weight by its input scales and folds their "
                                                      "inverse into the op before: it is not comparable alone "
                                                      "(qtool eval compares the whole model)")
            elif name not in self.ref.tensors:
                self.add("reference", m.name, "fail", f"the reference has no tensor '{name}'; fix: give the "
                                                      "dense model this checkpoint was made from")
            else:
                from qtool.errors import QtoolError

                try:
                    w = self.ref.get(name)
                except QtoolError as e:
                    self.add("reference", m.name, "fail", f"reference unreadable: {e.problem}")
                else:
                    self.add("reference", m.name, *numeric.reference(plain, w))
        if "kernels" in self.on:
            self._kernels(m, plain)

    def _kernels(self, m, plain) -> None:
        from qtool.validate import kernelcheck

        key = kernelcheck.layer_key(plain)
        if key in self.kernel_keys:
            return
        self.kernel_keys.add(key)
        shape = kernelcheck.describe_layer(plain)
        try:
            run, refused = kernelcheck.eligible(plain, self.device, self.opt.kernels)
        except Exception as e:  # noqa: BLE001 - a layer no kernel layout holds is a finding
            from qtool.errors import QtoolError

            self.add("kernels", m.name, "fail", f"{shape}: cannot build the kernel layer: "
                                                f"{e.problem if isinstance(e, QtoolError) else e}")
            return
        for kid, why in refused:
            self.add("kernels", m.name, "skip", f"{shape}: {kid} not eligible here: {why}", {"kernel": kid})
        if not run:
            self.add("kernels", m.name, "fail", f"{shape}: no kernel runs this layer on {self.device}")
        for kernel, layer in run:
            status, detail, numbers = kernelcheck.run_kernel(kernel, layer, plain, self.device,
                                                             self.opt.batch_sizes)
            self.add("kernels", m.name, status, f"{shape}: {detail}", {"kernel": kernel.id, **numbers})


def _max_diff(a, b) -> float:
    import torch

    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0
