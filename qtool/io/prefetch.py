"""Reading a known sequence of tensors one ahead, on a background thread, into reused buffers.

A command that converts tensors one at a time (pack) spends a core on its conversion; reading the next tensor
meanwhile (a positioned read releases the GIL) keeps a second one busy. The buffers are allocated once, sized
for the largest tensor, and reused: fresh memory for every tensor costs a page fault per 4 KiB page, on these
VMs as much as copying the bytes from the page cache.

    reader = Prefetcher([info, ...])      # the tensors, in the order they will be asked for
    w = reader.get(name)                  # a torch tensor valid until the next get() or close()
    reader.close()

The reads are read_tensor's (checked for length, never mapped): errors are its InputError, raised by get()
for the tensor they belong to. `read` replaces read_tensor with a function (info, buffer) -> anything that
reads the tensor into the numpy uint8 buffer and may do more on the reader thread while the bytes are in its
cache (pack takes the block maxima there); get() returns what it returns.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from qtool.io.safetensors_header import TensorInfo

SLOTS = 2  # the tensor being converted and the one being read


class Prefetcher:
    def __init__(self, infos: list[TensorInfo], read=None):
        self._infos = list(infos)
        self._read = read
        self._next = 0  # index of the tensor the next get() returns
        self._size = max((i.nbytes for i in self._infos), default=0)
        self._bufs: list = [None] * SLOTS
        self._pending: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qtool-read")
        self._submit()

    def _buffer(self, slot: int):
        import numpy as np

        if self._bufs[slot] is None:
            self._bufs[slot] = np.empty(self._size, dtype=np.uint8)
        return self._bufs[slot]

    def _submit(self) -> None:
        from qtool.io.checkpoint import read_tensor

        k = self._next
        if k < len(self._infos):
            buf = self._buffer(k % SLOTS)
            if self._read is None:
                self._pending = self._pool.submit(read_tensor, self._infos[k], False, buf)
            else:
                self._pending = self._pool.submit(self._read, self._infos[k], buf)

    def get(self, name: str):
        """The next tensor of the sequence, which must be `name` (a caller that skips one is a bug)."""
        k = self._next
        if k >= len(self._infos) or self._infos[k].name != name:
            raise RuntimeError(f"prefetch order: asked for {name!r}, next is "
                               f"{self._infos[k].name if k < len(self._infos) else None!r}")
        tensor = self._pending.result()  # read_tensor's InputError, if any, surfaces here
        self._next += 1
        self._submit()  # into the other slot: the tensor returned before this one is done with
        return tensor

    def close(self) -> None:
        """Wait for a read in flight (its buffer must outlive it) and stop the thread."""
        if self._pending is not None:
            self._pending.cancel()
            try:
                self._pending.exception()
            except BaseException:  # noqa: BLE001 - closing: the read's result no longer matters
                pass
        self._pool.shutdown(wait=True)
        self._bufs = [None] * SLOTS

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
