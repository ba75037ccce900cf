"""Fork server for tests/attacks: reads a JSON request on stdin, writes a JSON list of results on stdout.

Invoked by `tests.attacks.runner.run_batch`; see that module for why it exists.
"""

from __future__ import annotations

import json
import os
import sys

from tests.attacks.runner import serve

if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    # The children write to their own files; keep this process's stdout for the result alone.
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    results = serve(request)
    with os.fdopen(real_stdout, "wb") as f:
        f.write(json.dumps(results).encode())
