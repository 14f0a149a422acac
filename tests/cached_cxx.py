"""A C++ compiler command for the test session that compiles each distinct
build once: `python cached_cxx.py c++ ARGS... -o OUT`.

conftest.py sets CXX to it for the whole session, so ringreduce's TensorFlow
op (ringreduce/tensorflow/async_op.py, 15-25 s of g++) is compiled once even
though several tests build it into caches of their own (a read-only image's
`python -m ringreduce.tensorflow.async_op`, a damaged library rebuilt, a
filesystem without locks). Those tests pin what build() does around the
compiler (where the library goes, the rename into place, loading it), which
holds whatever the compiler command is.

The key of a build is its whole command line but the output path, and the
bytes of every argument that names a file (the source): a different source,
flag or TensorFlow include path is a different build. Headers are not read:
they do not change during a session. Builds run under an exclusive lock on
the cache, so ranks or xdist workers asking for the same build together run
the compiler once; a failed compile is not cached. Outside a test session
(RR_TEST_CXX_CACHE unset) it just runs the compiler.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path


def key(args: list[str]) -> str:
    h = hashlib.sha256()
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        h.update(a.encode() + b"\0")
        if i > 0 and not a.startswith("-") and os.path.isfile(a):
            h.update(Path(a).read_bytes() + b"\0")
    return h.hexdigest()[:32]


def main(argv: list[str]) -> int:
    cache = os.environ.get("RR_TEST_CXX_CACHE")
    if not cache or "-o" not in argv:
        return subprocess.call(argv)
    out = Path(argv[argv.index("-o") + 1])
    cache_dir = Path(cache)
    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key(argv)
    with open(cache_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not entry.exists():
            code = subprocess.call(argv)
            if code != 0:
                return code
            tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
            shutil.copyfile(out, tmp)
            os.replace(tmp, entry)
            return 0
    shutil.copyfile(entry, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
