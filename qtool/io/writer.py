"""Writing outputs safely: atomic destinations and a streaming, sharded safetensors writer.

Atomicity: every output is built under a hidden temporary name `.qtool-tmp-PID-RANDOM` beside the
destination and published only when complete, with a rename that refuses to replace anything (so a
destination that appears meanwhile is never clobbered). An existing destination is refused unless `force`,
and with `force` only an empty directory, a GGUF file or an earlier qtool output is replaced (see
replace_problem): the new one is fsynced and then swapped in, atomically where Linux offers
renameat2(RENAME_EXCHANGE), and the old one is deleted after. A run killed with SIGKILL leaves at most
hidden `.qtool-tmp-PID-*` entries, never a partial destination; the next run in that directory cleans up
those whose process is gone. SIGINT, SIGTERM and SIGHUP remove the temporary output (qtool.signals).

Durability: a *new* destination is published without waiting for the disk, as cp, safetensors and
llama.cpp's tools do (a power cut before the kernel writes it back can lose the new output, never the
input); a *replaced* destination is fsynced first, because there the old output would be lost with it.
`sync=True` forces the fsync in every case.

Streaming: tensors are written to the shard file as they arrive (nothing is buffered beyond one tensor), so
peak memory is the largest tensor, not the shard. The header goes into space reserved at the front of the
file and is padded with spaces, as the safetensors format allows; if it outgrows the reservation the
shard is rewritten once with a larger header.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import math
import os
import re
import shutil
import stat
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from qtool.errors import InputError, OutputError
from qtool.io.checkpoint import PICKLE_INDEX_SUFFIXES
from qtool.io.checkpoint import TMP_PREFIX as TMP_TAG
from qtool.io.safetensors_header import TensorInfo

HEADER_RESERVE = 64 << 10  # minimum bytes reserved for a shard's JSON header; 8-aligned
DEFAULT_MAX_SHARD = 4_000_000_000


def _test_write_delay() -> float:
    """QTOOL_TEST_WRITE_DELAY=SECONDS (tests only): sleep that long before writing each tensor, so that a
    test can signal or race a run while it is writing."""
    try:
        return max(float(os.environ.get("QTOOL_TEST_WRITE_DELAY") or 0), 0.0)
    except ValueError:
        return 0.0


_WRITE_DELAY = _test_write_delay()

_TORCH_TO_ST = {
    "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64",
    "torch.int8": "I8", "torch.uint8": "U8", "torch.int16": "I16", "torch.int32": "I32", "torch.int64": "I64",
    "torch.bool": "BOOL", "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2",
    "torch.uint16": "U16", "torch.uint32": "U32", "torch.uint64": "U64",
}


def st_dtype(t) -> str:
    """safetensors dtype name of a torch tensor."""
    key = str(t.dtype)
    if key not in _TORCH_TO_ST:
        raise OutputError(f"cannot store dtype {t.dtype} in safetensors")
    return _TORCH_TO_ST[key]


def parse_size(text: str | int) -> int:
    """'4GB', '500MB', '2GiB', '1000' -> bytes (at least 1)."""
    if isinstance(text, int) and not isinstance(text, bool):
        val, mult = float(text) if abs(text) < 1 << 1000 else float("inf"), 1
    else:
        s = str(text).strip().upper().replace(" ", "")
        units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
                 "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
        unit = next((u for u in units if s.endswith(u)), "B")
        num, mult = (s[: -len(unit)] if s.endswith(unit) else s), units[unit]
        try:
            val = float(num)
        except ValueError:
            raise OutputError(f"cannot read size '{str(text)[:40]}'", fix="use e.g. 4GB, 500MB or 2GiB") from None
    # inf, nan and sizes under one byte would reach int() or the shard arithmetic as nonsense
    if not math.isfinite(val * mult) or val * mult < 1:
        raise OutputError(f"size '{str(text)[:40]}' must be a positive, finite number of bytes",
                          fix="use e.g. 4GB, 500MB or 2GiB")
    return int(val * mult)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(p: Path) -> None:
    if not os.path.lexists(p):  # never created: on a read-only file system unlink says EROFS, not ENOENT
        return
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


# This process's temporary outputs that are neither published nor removed yet. A Ctrl-C can land where no
# handler of atomic_output sees it: after the mkdir and before its try, or in contextlib's __enter__ after the
# generator has yielded and before the with block is set up (a loaded machine can deschedule the process at
# exactly that point). The exit hook below removes what such an interrupt leaves.
_LIVE: set[Path] = set()
# This process's published outputs, in order. A signal held back over a publish (signals.deferred) is raised
# once the publish is complete, and so can a later one: the CLI's interrupt line names what was written.
PUBLISHED: list[Path] = []


def _remove_live() -> None:
    """atexit: remove this process's unpublished temporary outputs (see _LIVE); a forked child that exits
    through atexit leaves its parent's alone (their names carry the parent's pid)."""
    mine = f"{TMP_TAG}{os.getpid()}-"
    for p in sorted(_LIVE):
        if p.name.startswith(mine):
            _remove(p)
    _LIVE.clear()


atexit.register(_remove_live)


def _tmp_name(pid: int | None = None) -> str:
    """`.qtool-tmp-PID-RANDOM`: at most 36 bytes whatever the destination's name, so any destination name
    that fits the filesystem's 255-byte limit has a temporary sibling that fits too."""
    return f"{TMP_TAG}{os.getpid() if pid is None else pid}-{os.urandom(6).hex()}"


def clean_stale(dest: Path) -> None:
    """Tidy up after earlier runs in the destination's directory that were killed (their process no longer
    exists): remove their temporary outputs; and if one died in the instant between moving an old
    destination aside and moving the new one in (only possible where the atomic exchange is unavailable),
    put the old one back under the name its `-dest` record holds rather than delete it."""
    parent = dest.parent if str(dest.parent) else Path(".")
    if not parent.is_dir():
        return
    try:
        entries = sorted(p for p in parent.iterdir() if p.name.startswith(TMP_TAG))
    except OSError:
        return
    for p in entries:
        pid = p.name[len(TMP_TAG):].split("-")[0]
        if not pid.isdigit() or _pid_alive(int(pid)) or p.name.endswith("-dest"):
            continue
        if p.name.endswith("-old"):
            record = p.with_name(p.name[: -len("-old")] + "-dest")
            with contextlib.suppress(OSError):
                name = os.readlink(record)
                if Path(name).name == name and not _exists(parent / name):
                    os.rename(p, parent / name)
        _remove(p)
    for p in entries:  # the records last: each one is needed until its old output is back in place
        if p.name.endswith("-dest") and not _exists(p.with_name(p.name[: -len("-dest")] + "-old")):
            pid = p.name[len(TMP_TAG):].split("-")[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                _remove(p)


def _exists(p: Path) -> bool:
    return p.exists() or p.is_symlink()  # a dangling symlink is still something not to clobber


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2(a, b, flags). Returns False where the kernel, libc or filesystem lacks it (the caller
    falls back); raises OSError for any other failure (EEXIST for RENAME_NOREPLACE onto an existing b)."""
    fn = _libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
    if fn is None:  # not Linux, glibc < 2.28, musl
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (RENAME_EXCHANGE); False where unavailable."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _rename_noreplace(tmp: Path, dest: Path) -> None:
    """Move tmp to dest only if dest does not exist, in one atomic step; FileExistsError otherwise.

    Linux: renameat2(RENAME_NOREPLACE) (ext4, xfs, btrfs, tmpfs, overlayfs...). Elsewhere a file is
    published with link(tmp, dest), which fails atomically on an existing dest, then tmp is unlinked; a
    directory claims dest with mkdir (atomic, fails on an existing dest) and is renamed over that empty
    directory (rename(2) replaces an empty directory in one step; a process that wrote into it in the
    instant between makes the rename fail, and that is refused too). Killed in that instant, such a run
    leaves an empty dest directory behind."""
    if _renameat2(tmp, dest, _RENAME_NOREPLACE):
        return
    if not tmp.is_dir():
        try:
            os.link(tmp, dest)
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EXDEV, *_UNSUPPORTED):
                raise
            # no hard links here either (FAT, some FUSE): the check and the rename are two steps
            if _exists(dest):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dest)) from None
            os.rename(tmp, dest)
            return
        os.unlink(tmp)
        return
    os.mkdir(dest)  # FileExistsError when it exists
    try:
        os.rename(tmp, dest)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(errno.EEXIST, "written to by another process meanwhile", str(dest)) from None
        with contextlib.suppress(OSError):
            os.rmdir(dest)
        raise


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and root), so a rename that publishes it can never be
    on disk before the data it names (power loss after the rename would otherwise leave empty files)."""
    paths = [root] if root.is_file() else [*(q for q in root.rglob("*") if q.is_file() and not q.is_symlink()),
                                           *(q for q in root.rglob("*") if q.is_dir()), root]
    for q in paths:
        _fsync_path(q)


_LIBC: dict = {}


def _libc(name: str, argtypes: list, restype=ctypes.c_int):
    """A libc function through ctypes (looked up once), or None where this platform or libc lacks it."""
    if name not in _LIBC:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = getattr(ctypes.CDLL(None, use_errno=True), name)
                fn.argtypes, fn.restype = argtypes, restype
            except (OSError, AttributeError):  # glibc too old, musl, ...
                fn = None
        _LIBC[name] = fn
    return _LIBC[name]


_WRITEBACK_CHUNK = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset+nbytes) of `fd` to disk now, without waiting for it
    (Linux sync_file_range(SYNC_FILE_RANGE_WRITE)). A streaming writer calls this as it goes so that the
    fsync before publishing finds little left to do: the disk works while the next tensors are converted,
    instead of all at the end. A no-op where the call is unavailable."""
    fn = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
    if fn is not None and nbytes > 0:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # failure only means a slower fsync later


def _fsync_path(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; nothing more can be done there
        pass
    finally:
        os.close(fd)


# errnos that mean "the destination cannot take the output", whichever file the write was for
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _space_note(dest: Path, need: int | None) -> str:
    """', about 1.2 GB needed, 300.0 MB free there' (the parts that are known)."""
    parts = []
    if need:
        parts.append(f"about {_human(need)} needed")
    try:
        st = os.statvfs(dest.parent if str(dest.parent) else ".")
        parts.append(f"{_human(st.f_bavail * st.f_frsize)} free there")
    except OSError:
        pass
    return "".join(f", {p}" for p in parts)


def _human(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _output_error(e: OSError, dest: Path, tmp: Path, need: int | None) -> OutputError | None:
    fname = str(e.filename or "")
    if e.errno in _OUTPUT_ERRNOS or (fname and fname.startswith(str(tmp))):
        note = _space_note(dest, need) if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
        return OutputError(f"cannot write the output ({e.strerror or type(e).__name__}{note}); nothing was written",
                           path=dest, fix="free space or choose another -o")
    return None


# --- what the source is ---------------------------------------------------------------------------------
def source_paths(src: str | Path) -> set[Path]:
    """Every path a source resolves to: SRC itself, each shard its index names, the index and configs, every
    member of a split GGUF, and the files copied from its directory. What cannot be opened adds nothing
    here (the command reports it when it reads the source)."""
    from qtool.errors import QtoolError

    p = Path(src)
    out = {p}
    if p.suffix != ".gguf":
        from qtool.io.checkpoint import INDEX_NAME, open_checkpoint

        try:
            ck = open_checkpoint(p)
            out.update(ck.files)
            out.update(q for q in (ck.root / INDEX_NAME, ck.root / "config.json", ck.root / "quantize_config.json")
                       if _exists(q))
            out.update(ck.other_files())
        except QtoolError:
            pass
    if p.suffix == ".gguf" or p.is_dir():
        from qtool.io.gguf_reader import resolve_gguf

        try:
            out.update(resolve_gguf(p)[1])
        except QtoolError:
            pass
    return out


def _aliases(p: Path) -> set[Path]:
    """The names a path is reached by: as given (made absolute), with its directory's links resolved (the
    entry itself, which a rename would replace), and fully resolved (where a link leads)."""
    absolute = Path(os.path.abspath(p))
    return {absolute, Path(os.path.realpath(absolute.parent)) / absolute.name, Path(os.path.realpath(absolute))}


def refuse_overwriting_input(src: str | Path, dest: str | Path) -> None:
    """Inputs are never modified: refuse a destination that is, contains or lies inside any path the source
    resolves to (see source_paths), comparing every name each is reached by (links resolved or not)."""
    dests = _aliases(Path(dest))
    for x in sorted(source_paths(src)):
        for a in _aliases(x):
            for d in dests:
                if a == d or d in a.parents or a in d.parents:
                    what = "the input" if x == Path(src) else "an input file"
                    raise OutputError(f"the destination overlaps {what} {x}", path=dest,
                                      fix="write the output somewhere else (-o); inputs are never modified")


# --- files copied from the source directory ----------------------------------------------------------------
def copy_extras(files: list[Path], root: Path, out: Path, sub_dirs: list[Path] = (),
                left_out: list[Path] = ()) -> list[str]:
    """Copy a source directory's extra files (tokenizer, generation config, ...) and its sub-directories
    (sentence-transformers modules such as 1_Pooling/, which modules.json names) into the output `out`.
    Returns a warning for everything not copied as it is, `left_out` (entries that are not part of the model
    read: Checkpoint.left_out_files) included; nothing is left out silently.

    The rule: no link is followed out of the source directory.
    - a regular file is copied; a sub-directory is copied with everything in it, by the same rule;
    - a symbolic link whose target resolves inside the source directory is copied as a link (the same
      link text); if that target is not part of the output the warning says so;
    - a symbolic link that leads outside the source directory (or nowhere) is not copied: it could expose
      any file the user can read (a private key, /proc/self/environ) in an output meant to be shared;
    - anything else (FIFO, socket, device) is not copied."""
    base = os.path.realpath(root)
    warnings: list[str] = []
    for p in left_out:
        if p.is_dir() and not p.is_symlink():
            warnings.append(f"{p.name}/: sub-directory not copied: the source is one file, and carries the files "
                            "beside it, not its folder's sub-directories; give the directory to copy them")
            continue
        if p.name.endswith(PICKLE_INDEX_SUFFIXES):
            why = "the index of pickle shards, which qtool never reads or writes (it would name files the output " \
                  "does not hold)"
        elif p.name.endswith(".index.json"):
            why = "a shard index other than the one read (the output writes its own where it is sharded)"
        elif p.suffix == ".safetensors":
            why = "weights that are not part of the model read (not model.safetensors, not in the index)"
        else:
            why = "a pickle, never loaded"
        warnings.append(f"{p.name}: not copied: {why}")
    links: list[tuple[Path, Path]] = []
    _copy_entries(files, Path(root), base, out, warnings, links)
    for d in sub_dirs:
        _copy_dir(d, Path(root), base, out / d.name, warnings, links)
    for p, dst in links:
        if not dst.exists():
            warnings.append(f"{p.relative_to(root)}: copied as a link to {os.readlink(p)}, which is not part of "
                            "the output")
    return warnings


# a source sub-directory tree larger than this is not model files: it is named in a warning, not copied
MAX_CARRIED_ENTRIES = 10_000


def _copy_dir(d: Path, root: Path, base: str, dst: Path, warnings: list[str], links: list) -> None:
    try:
        entries = sorted(d.iterdir())
    except OSError as e:
        warnings.append(f"{d.relative_to(root)}/: sub-directory not copied: it cannot be listed ({e.strerror})")
        return
    if len(entries) > MAX_CARRIED_ENTRIES:
        warnings.append(f"{d.relative_to(root)}/: sub-directory not copied: it holds over {MAX_CARRIED_ENTRIES} "
                        "entries")
        return
    dst.mkdir()
    subs = [p for p in entries if p.is_dir() and not p.is_symlink()]
    _copy_entries([p for p in entries if p not in subs], root, base, dst, warnings, links)
    for p in subs:
        _copy_dir(p, root, base, dst / p.name, warnings, links)


def _copy_entries(files: list[Path], root: Path, base: str, out: Path, warnings: list[str], links: list) -> None:
    for p in files:
        rel = p.relative_to(root) if p.is_relative_to(root) else p.name
        try:
            if p.is_symlink():
                target = os.readlink(p)
                real = os.path.realpath(p)
                inside = os.path.commonpath([base, real]) == base
                if inside and os.path.exists(real):
                    os.symlink(target, out / p.name)
                    links.append((p, out / p.name))
                elif inside:  # dangling, or a loop of links
                    warnings.append(f"{rel}: not copied: a symbolic link to {target}, which leads to no file")
                else:
                    warnings.append(f"{rel}: not copied: a symbolic link to {target}, outside the source "
                                    "directory (qtool follows no link out of it; copy the file in if it is "
                                    "needed)")
            elif p.is_file():
                shutil.copy2(p, out / p.name, follow_symlinks=False)
            else:
                warnings.append(f"{rel}: not copied: not a regular file")
        except FileNotFoundError:
            warnings.append(f"{rel}: not copied: it disappeared during the run")


# --- what --force may replace -------------------------------------------------------------------------------
_MAX_LISTED = 100_000  # a directory with more entries than this is not an output qtool wrote


def replace_problem(dest: Path) -> tuple[str | None, tuple[int, int] | None]:
    """(why --force must not replace dest, or None; dest's (device, inode) when it may).

    The rule: --force replaces only what qtool could have written there
    - a regular file that is empty or a GGUF file (qtool's single-file output);
    - a directory that is empty, or whose model.safetensors (or first shard model-00001-of-N.safetensors)
      carries qtool's `qtool.version` metadata, as every pack and repack output does (its sub-directories
      are the source's, carried over).
    Never a symbolic link, a device, a FIFO or a socket, and never anything else."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return None, None
    ident = (st.st_dev, st.st_ino)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link", None
    if stat.S_ISREG(st.st_mode):
        if st.st_size == 0:
            return None, ident
        try:
            with open(dest, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            return f"it cannot be read ({e.strerror})", None
        return (None, ident) if magic == b"GGUF" else ("it is a file that is not a GGUF file", None)
    if not stat.S_ISDIR(st.st_mode):
        return "it is a device, FIFO or socket", None
    try:
        entries = []
        with os.scandir(dest) as it:
            for e in it:
                entries.append(e)
                if len(entries) > _MAX_LISTED:
                    return f"it holds over {_MAX_LISTED} entries", None
        if not entries:
            return None, ident
        names = {e.name: e for e in entries}
        shards = sorted(n for n in names if re.fullmatch(r"model-00001-of-\d{5}\.safetensors", n))
        first = "model.safetensors" if "model.safetensors" in names else (shards[0] if shards else None)
        if first is None or not names[first].is_file(follow_symlinks=False):
            return "it is not a qtool output (no model.safetensors or first shard)", None
        from qtool.errors import QtoolError
        from qtool.io.safetensors_header import read_header

        try:
            _, meta = read_header(dest / first)
        except QtoolError:
            return f"it is not a qtool output ({first} is not a readable safetensors file)", None
        if "qtool.version" not in meta:
            return f"it is not a qtool output ({first} carries no qtool.version metadata)", None
    except OSError as e:
        return f"it cannot be listed ({e.strerror})", None
    return None, ident


def _check_replaceable(dest: Path) -> tuple[int, int] | None:
    why, ident = replace_problem(dest)
    if why is not None:
        raise OutputError(f"--force replaces only an empty directory, a GGUF file or an earlier qtool output; "
                          f"{why}", path=dest, fix="remove it yourself if it is to go, or choose another -o")
    return ident


# --- atomic output ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_output(dest: str | Path, force: bool = False, *, directory: bool = True,
                  sync: bool | None = None, need_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path (a created directory, or a file path when directory=False) to write into;
    on normal exit it is published as `dest`; on any exception (Ctrl-C, SIGTERM and SIGHUP included) it is
    removed and dest is untouched.

    The temporary path is a hidden sibling `.qtool-tmp-PID-RANDOM` (same filesystem, so the final rename is
    atomic; its short fixed-length name fits wherever dest's name does). Missing parent directories of
    dest are created (and stay if the run fails). Publishing:
    - without force: one no-replace rename (see _rename_noreplace): a destination that appeared meanwhile
      (another run, the user) is left as it is and the run fails, so of two runs to one new destination
      exactly one wins;
    - with force: only what replace_problem allows is replaced, checked before the work and again at the
      swap: renameat2(RENAME_EXCHANGE) where Linux offers it (at every instant dest is the old output or
      the new one), else move aside, move in, delete the old (put back if the move in fails).
    sync: fsync the new contents before publishing them; None (default) = only when an existing destination
    is replaced (see the module docstring). need_bytes: the output's expected size, for the disk-full error.
    Errors writing the destination (disk full, read-only, permissions) become OutputError.
    """
    from qtool.paths import check_path_length

    dest = Path(dest)
    check_path_length(dest, "-o")
    if _exists(dest):
        if not force:
            raise OutputError("destination exists", path=dest, fix="choose another -o, or pass --force to replace it")
        _check_replaceable(dest)
    if sync is None:
        sync = _exists(dest)
    parent = dest.parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create its parent directory ({e.strerror or type(e).__name__})", path=dest,
                              fix="choose a writable -o") from None
    clean_stale(dest)
    tmp = parent / _tmp_name()
    _LIVE.add(tmp)  # before it exists: removed at exit unless published or removed below
    try:
        yield from _fill_and_publish(tmp, dest, directory, sync, force, need_bytes)
    finally:
        _LIVE.discard(tmp)


def _fill_and_publish(tmp: Path, dest: Path, directory: bool, sync: bool, force: bool,
                      need: int | None) -> Iterator[Path]:
    """atomic_output's body once the temporary name is registered: create it, yield it, then publish it (or
    remove it on any exception)."""
    from qtool.signals import deferred

    try:
        if directory:
            tmp.mkdir()
    except OSError as e:
        raise OutputError(f"cannot create the output beside it ({e.strerror or type(e).__name__})", path=dest,
                          fix="choose a writable -o") from None
    try:
        yield tmp
    except OSError as e:
        _remove(tmp)
        err = _output_error(e, dest, tmp, need)
        if err is None:
            raise
        raise err from None
    except BaseException:
        _remove(tmp)
        raise
    try:
        if sync:
            _sync_tree(tmp)
        with deferred():  # a signal waits until the renames are done: never half a publish
            _publish(tmp, dest, force)
            PUBLISHED.append(dest)
        if sync:
            _fsync_path(dest.parent)
    except OutputError:
        _remove(tmp)
        raise
    except OSError as e:
        _remove(tmp)
        raise OutputError(f"cannot move the finished output into place ({e.strerror or type(e).__name__})",
                          path=dest, fix="check permissions of the destination and its directory") from None
    except BaseException:
        _remove(tmp)
        raise


def _publish(tmp: Path, dest: Path, force: bool) -> None:
    """Move the finished tmp to dest (see atomic_output for the rules)."""
    if not force or not _exists(dest):
        try:
            _rename_noreplace(tmp, dest)
            return
        except FileExistsError:
            if not force:
                raise OutputError("the destination appeared while qtool was writing; it was left as it is and "
                                  "nothing was written", path=dest,
                                  fix="choose another -o, or pass --force to replace it") from None
    ident = _check_replaceable(dest)
    if _exchange(tmp, dest):
        st = os.lstat(tmp)  # now the old destination: the one checked, unless it was swapped meanwhile
        if (st.st_dev, st.st_ino) != ident:
            _exchange(tmp, dest)
            raise OutputError("the destination changed while qtool was replacing it; it was left as it is",
                              path=dest, fix="run again")
        _remove(tmp)
        return
    if tmp.is_file() and stat.S_ISREG(os.lstat(dest).st_mode):
        os.replace(tmp, dest)  # file over file: rename(2) is already atomic
        return
    old = tmp.with_name(tmp.name + "-old")
    record = tmp.with_name(tmp.name + "-dest")  # tells clean_stale where `old` goes back if this run dies
    os.symlink(dest.name, record)
    try:
        os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except BaseException:
            os.rename(old, dest)
            raise
        _remove(old)
    finally:
        with contextlib.suppress(OSError):
            record.unlink()


class ShardedWriter:
    """Stream tensors into `model.safetensors`, or into `model-0000k-of-0000n.safetensors` shards plus
    `model.safetensors.index.json` when the total exceeds `max_shard_size` bytes.

    metadata: str -> str, written into every shard; {"format": "pt"} is always included.
    expected_tensors: how many tensors the caller will add (an upper bound for any shard); sizes the header
    space reserved at the front of each shard so the header never has to be rewritten.
    writeback: start the disk writes as data arrives (for an output that will be fsynced before it is
    published, so the fsync finds little left to do).
    """

    def __init__(self, directory: Path, max_shard_size: int = DEFAULT_MAX_SHARD,
                 metadata: dict[str, str] | None = None, expected_tensors: int = 0, writeback: bool = False):
        self.dir = Path(directory)
        self.writeback = writeback
        self.max = max_shard_size
        self.metadata = {"format": "pt", **(metadata or {})}
        meta_len = len(json.dumps(self.metadata)) + 32
        # ~100 bytes of JSON per entry plus the name; 256 covers names up to ~150 characters
        self.reserve = max(HEADER_RESERVE, -(-(meta_len + 256 * expected_tensors) // 8) * 8)
        self._shards: list[tuple[Path, list[str]]] = []
        self._f = None
        self._entries: dict[str, dict] = {}
        self._pos = 0
        self._kicked = 0
        self._total = 0
        self._names: set[str] = set()
        self._piece: list | None = None  # the tensor begin_tensor started: name, dtype, shape, bytes, done

    # --- adding ------------------------------------------------------------------------------------
    def add(self, name: str, tensor) -> None:
        """Append one tensor (any device/layout; written little-endian, C order)."""
        import torch

        t = tensor.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        self._begin(name, n)
        if n:
            # write(2), not a shared map of the file: on these VMs a map's page faults cost more than the copy
            # (3 GB of 120 MB tensors: 1.33 GB/s and 0.38 CPU-s/GB by write, 0.54-0.72 GB/s and 0.67-0.91 by a
            # map after fallocate)
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._finish(name, st_dtype(t), list(t.shape), n)

    def begin_tensor(self, name: str, dtype: str, shape: list[int], nbytes: int) -> None:
        """Start a tensor whose bytes arrive in pieces (`write_chunk`, then `end_tensor`), so a tensor larger
        than the memory one wants to spend on it is written without ever being whole in memory."""
        self._begin(name, nbytes)
        self._piece = [name, dtype, list(shape), nbytes, 0]

    def write_chunk(self, tensor) -> None:
        """The next bytes of the tensor `begin_tensor` started (C order, any dtype: its bytes are written)."""
        import torch

        name, _, _, total, done = self._piece
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        if done + n > total:
            raise OutputError(f"tensor '{name}' was given {done + n} bytes for {total}", tensor=name)
        if n:
            self._f.write(memoryview(flat.numpy()))
        self._piece[4] = done + n

    def end_tensor(self) -> None:
        name, dtype, shape, total, done = self._piece
        if done != total:
            raise OutputError(f"tensor '{name}' ended after {done} of its {total} bytes", tensor=name)
        self._piece = None
        self._finish(name, dtype, shape, total)

    def add_raw(self, name: str, info: TensorInfo) -> None:
        """Copy a tensor's bytes from a source file unchanged (byte for byte): inside the kernel where it can
        (copy_file_range(2): no copy through this process), else read and written in 16 MiB pieces."""
        n = info.nbytes
        self._begin(name, n)
        with info.file.open("rb") as src:
            done = self._copy_range(src, info.start, n) if n else 0
            src.seek(info.start + done)
            left = n - done
            while left:
                chunk = src.read(min(left, 16 << 20))
                if not chunk:
                    raise InputError(f"file ends after {n - left} of the tensor's {n} bytes", path=info.file,
                                     tensor=name, fix="the file is truncated or was changed during the run")
                self._f.write(chunk)
                left -= len(chunk)
        self._finish(name, info.dtype, list(info.shape), n)

    def _copy_range(self, src, start: int, n: int) -> int:
        """Bytes [start, start + n) of src appended by copy_file_range(2); how many were copied (fewer where
        the file ends early or the call is unavailable: the caller reads the rest, and names a short file)."""
        if not hasattr(os, "copy_file_range"):
            return 0
        self._f.flush()
        dst = self._f.fileno()
        at = self._f.tell()
        done = 0
        try:
            while done < n:
                got = os.copy_file_range(src.fileno(), dst, n - done, start + done, at + done)
                if not got:
                    break
                done += got
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF,
                               errno.EPERM):
                raise
        self._f.seek(at + done)
        return done

    def _begin(self, name: str, nbytes: int) -> None:
        if name in self._names:
            raise OutputError(f"tensor '{name}' written twice", tensor=name)
        self._names.add(name)
        if self._f is not None and self._pos > 0 and self._pos + nbytes > self.max:
            self._close_shard()
        if self._f is None:
            self._open_shard()
        if _WRITE_DELAY:
            time.sleep(_WRITE_DELAY)

    def _finish(self, name: str, dtype: str, shape: list[int], n: int) -> None:
        self._entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [self._pos, self._pos + n]}
        self._pos += n
        self._total += n
        if self.writeback and self._pos - self._kicked >= _WRITEBACK_CHUNK:
            self._f.flush()
            start_writeback(self._f.fileno(), 8 + self.reserve + self._kicked, self._pos - self._kicked)
            self._kicked = self._pos

    # --- shards ------------------------------------------------------------------------------------
    def _open_shard(self) -> None:
        k = len(self._shards) + 1
        path = self.dir / f"model-{k:05d}.safetensors.part"
        self._f = path.open("wb")
        self._f.seek(8 + self.reserve)
        self._shards.append((path, []))
        self._entries = {}
        self._pos = 0
        self._kicked = 0  # data bytes of this shard already handed to start_writeback

    def _close_shard(self) -> None:
        path, names = self._shards[-1]
        names.extend(self._entries)
        header = {"__metadata__": self.metadata, **self._entries}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(raw) <= self.reserve:
            self._f.seek(0)
            self._f.write(struct.pack("<Q", self.reserve))
            self._f.write(raw + b" " * (self.reserve - len(raw)))
            self._f.close()
        else:  # rare: very many tensors in one shard; rewrite once with an exact header
            self._f.close()
            pad = (-len(raw)) % 8
            fixed = path.with_suffix(".rewrite")
            with path.open("rb") as src, fixed.open("wb") as dst:
                dst.write(struct.pack("<Q", len(raw) + pad))
                dst.write(raw + b" " * pad)
                src.seek(8 + self.reserve)
                shutil.copyfileobj(src, dst, 16 << 20)
            os.replace(fixed, path)
        self._f = None

    def close(self) -> list[Path]:
        """Finish the last shard, name the files, write the index when sharded. Returns the files."""
        if self._f is None and not self._shards:
            self._open_shard()  # an empty model still gets a valid file
        if self._f is not None:
            self._close_shard()
        n = len(self._shards)
        final: list[Path] = []
        weight_map: dict[str, str] = {}
        for k, (path, names) in enumerate(self._shards, start=1):
            name = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
            target = self.dir / name
            os.replace(path, target)
            final.append(target)
            for t in names:
                weight_map[t] = name
        if n > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return final

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


class BackgroundWriter:
    """The ShardedWriter API, with the writing done on one background thread, so reading and converting the
    next module overlaps writing the previous one (file I/O and torch ops release the GIL).

    At most `depth` tensors wait in the queue, so memory stays a small multiple of the largest tensor. An
    error on the writer thread is raised in the caller at its next call. As a context manager it closes the
    files when the block ends (`files` then lists them) and aborts when the block or the close raises, after
    stopping the thread, so the caller's temporary output is never removed under a running write.
    """

    _STOP = object()

    def __init__(self, writer: ShardedWriter, depth: int = 4):
        import queue
        import threading

        self.w = writer
        self.files: list[Path] | None = None  # the shards written, once closed
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qtool-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is self._STOP:
                return
            if self._error is not None and item[0] != "call":
                continue  # drain: the caller sees the error at its next call (callbacks still run)
            method, name, payload = item
            if method == "call":  # a caller's callback, run once everything queued before it is written
                payload()
                continue
            try:
                if method == "apply":
                    payload(self.w)
                elif method == "add_many":
                    for n, t in payload:
                        self.w.add(n, t)
                else:
                    getattr(self.w, method)(name, payload)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self._error = e

    def _put(self, item) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(item)

    def add(self, name: str, tensor) -> None:
        self._put(("add", name, tensor))

    def add_raw(self, name: str, info: TensorInfo) -> None:
        self._put(("add_raw", name, info))

    def add_many(self, items: list[tuple[str, object]]) -> None:
        """Add several (name, tensor) pairs as one queue item (one hand-over between the threads per module
        instead of per tensor; the queue's depth then counts modules)."""
        self._put(("add_many", "", list(items)))

    def apply(self, fn) -> None:
        """Run fn(writer) on the writer thread in queue order, e.g. `lambda w: w.write_chunk(t)`: a tensor
        written in pieces then costs the queue's depth in pieces, not the whole tensor. Errors surface like a
        write's."""
        self._put(("apply", "", fn))

    def after_written(self, fn) -> None:
        """Run fn() on the writer thread once every tensor added before this call has been written (e.g. to
        hand a reusable buffer back). fn must not raise."""
        self._put(("call", "", fn))

    def _join(self) -> None:
        self._q.put(self._STOP)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> list[Path]:
        self._join()
        self.files = self.w.close()
        return self.files

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.files is not None:
            return
        if exc_type is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        try:
            self._join()
        except BaseException:  # noqa: BLE001 - aborting anyway; the original error is being raised
            pass
        self.w.abort()
