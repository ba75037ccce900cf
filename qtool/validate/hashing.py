"""Content hashes: one per tensor, one for the model, the same for any shard layout.

tensor digest = SHA-256 over "dtype shape nbytes\n" followed by the SHA-256 digests of the tensor's bytes in
CHUNK-byte pieces (a hash tree one level deep), so the pieces of a large tensor are hashed on several cores
at once (hashlib releases the GIL) while the digest stays independent of how the work was split.
model digest = SHA-256 over "name digest\n" for every tensor in name order: renaming, adding, removing or
changing any tensor changes it; moving tensors between shards does not.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

CHUNK = 16 << 20
ALGORITHM = f"sha256-tree-{CHUNK >> 20}MiB"


def _sha(piece) -> bytes:
    return hashlib.sha256(piece).digest()


class Hasher:
    """Hashes tensors' bytes on a small thread pool; `close()` when done."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or max(1, min(8, os.cpu_count() or 1))
        self.pool = ThreadPoolExecutor(max_workers=self.workers)

    def tensor(self, dtype: str, shape, data) -> str:
        """data: a contiguous buffer (numpy uint8 array or memoryview) of the tensor's stored bytes."""
        return self.submit(dtype, shape, data)()

    def submit(self, dtype: str, shape, data) -> Callable[[], str]:
        """Start hashing `data` on the pool; the returned function waits and gives the digest. The caller
        keeps `data` alive (the pieces are views of it) and may read the next tensor meanwhile."""
        mv = memoryview(data).cast("B")
        n = len(mv)
        futures = [self.pool.submit(_sha, mv[i:i + CHUNK]) for i in range(0, n, CHUNK)] or \
            [self.pool.submit(_sha, mv)]
        head = f"{dtype} {list(shape)} {n}\n".encode()

        def digest() -> str:
            h = hashlib.sha256(head)
            for f in futures:
                h.update(f.result())
            return h.hexdigest()

        return digest

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def model_digest(tensor_hashes: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensor_hashes):
        h.update(f"{name} {tensor_hashes[name]}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def compare(a: dict[str, str], b: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(tensors whose content differs, tensors only in a, tensors only in b), each in name order."""
    differ = sorted(n for n in a.keys() & b.keys() if a[n] != b[n])
    return differ, sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
