"""The fixtures in tests/fixtures are the files their provenance names: every file matches a checksum in
SHA256SUMS, seeds/SHA256SUMS or PROVENANCE.md's table, and no file is there that none of them covers."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from tests.conftest import FIXTURES, FIXTURES_HOME

SUMS = ("SHA256SUMS", "seeds/SHA256SUMS", "ct-float/SHA256SUMS", "fp4/SHA256SUMS", "ct-w4a8/SHA256SUMS")
PROVENANCE = "PROVENANCE.md"
# PROVENANCE.md pins the files no SHA256SUMS lists, in rows of `| `path` | `sha256` |`.
PINNED_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*`([0-9a-f]{64})`\s*\|\s*$")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_sums(root: Path, sums: str) -> dict[str, str]:
    """`sha256sum` lines of root/sums -> {path relative to root: digest}."""
    base = Path(sums).parent
    out = {}
    for i, line in enumerate((root / sums).read_text(encoding="utf-8").splitlines(), 1):
        m = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line)
        assert m, f"{root / sums}:{i}: not a sha256sum line: {line!r}"
        rel = (base / m.group(2)).as_posix()
        out[rel.removeprefix("./")] = m.group(1)
    return out


def pinned(root: Path) -> dict[str, str]:
    lines = (root / PROVENANCE).read_text(encoding="utf-8").splitlines()
    return {m.group(1): m.group(2) for m in map(PINNED_ROW.match, lines) if m}


def expected(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for sums in SUMS:
        if sums == SUMS[0] or (root / sums).is_file():  # the repository's count below notices a lost list
            out.update(read_sums(root, sums))
    out.update(pinned(root))
    return out


def mismatches(root: Path, digests: dict[str, str]) -> list[str]:
    bad = []
    for rel, digest in sorted(digests.items()):
        p = root / rel
        if not p.is_file():
            bad.append(f"{rel}: missing")
        elif sha256(p) != digest:
            bad.append(f"{rel}: sha256 {sha256(p)}, listed {digest}")
    return bad


def test_repository_fixtures_match_their_checksums():
    digests = expected(FIXTURES_HOME)
    # 32 upstream files, 3 seed files, 6 compressed-tensors 0.20 files (ct-float/), 16 NVFP4/MX files (fp4/),
    # 3 W4A8 files (ct-w4a8/), and README.md and the five SHA256SUMS lists pinned in PROVENANCE.md.
    assert len(digests) == 66
    assert mismatches(FIXTURES_HOME, digests) == []


def test_every_fixture_file_is_covered_by_a_checksum():
    files = {p.relative_to(FIXTURES_HOME).as_posix() for p in FIXTURES_HOME.rglob("*") if p.is_file()}
    assert files - set(expected(FIXTURES_HOME)) == {PROVENANCE}


def test_fixtures_the_tests_read_match_upstream_checksums():
    """FIXTURES is tests/fixtures unless QTOOL_FIXTURES points elsewhere; either way it must hold these files."""
    assert mismatches(FIXTURES, read_sums(FIXTURES_HOME, "SHA256SUMS")) == []


def test_checker_catches_a_changed_an_unlisted_and_a_missing_file(tmp_path):
    (tmp_path / "seeds").mkdir()
    (tmp_path / "a.bin").write_bytes(b"a")
    (tmp_path / "b.bin").write_bytes(b"b")
    (tmp_path / "seeds" / "s.txt").write_bytes(b"s")
    (tmp_path / "SHA256SUMS").write_text(f"{sha256(tmp_path / 'a.bin')}  ./a.bin\n{'0' * 64}  ./b.bin\n"
                                         f"{'1' * 64}  ./gone.bin\n")
    (tmp_path / "seeds" / "SHA256SUMS").write_text(f"{sha256(tmp_path / 'seeds' / 's.txt')}  ./s.txt\n")
    (tmp_path / PROVENANCE).write_text(f"| `SHA256SUMS` | `{sha256(tmp_path / 'SHA256SUMS')}` |\n")
    (tmp_path / "stray.bin").write_bytes(b"x")
    digests = expected(tmp_path)
    assert [m.split(":")[0] for m in mismatches(tmp_path, digests)] == ["b.bin", "gone.bin"]
    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert files - set(digests) == {PROVENANCE, "seeds/SHA256SUMS", "stray.bin"}
