"""Compare two safetensors checkpoints tensor by tensor, byte for byte (used by `make demo`).

    python scripts/same_tensors.py A B     -> exit 0 when every tensor has identical dtype, shape and bytes
"""

import hashlib
import sys

from qtool.io.checkpoint import open_checkpoint


def digests(path: str) -> dict[str, str]:
    ck = open_checkpoint(path)
    out = {}
    for name, info in ck.tensors.items():
        with info.file.open("rb") as f:
            f.seek(info.start)
            out[name] = f"{info.dtype}{list(info.shape)}:" + hashlib.sha256(f.read(info.nbytes)).hexdigest()
    return out


a, b = digests(sys.argv[1]), digests(sys.argv[2])
diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
print(f"{len(a)} tensors in A, {len(b)} in B; {len(diff)} differ" + (f": {diff[:5]}" if diff else
                                                                   " -- byte-identical"))
sys.exit(1 if diff else 0)
