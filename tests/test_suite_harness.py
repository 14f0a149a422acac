"""The suite's own machinery in tests/conftest.py: the compiler command that
builds each distinct TensorFlow-op build once per run (tests/cached_cxx.py),
and the `alone` marker that keeps the other xdist worker idle meanwhile."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAKE_CXX = """\
import sys
from pathlib import Path
args = sys.argv[1:]
with open(Path(__file__).with_name("calls"), "a") as f:
    f.write("x\\n")
source = Path(args[0]).read_text()
if "broken" in source:
    sys.exit(3)
Path(args[args.index("-o") + 1]).write_text("built from " + source)
"""


def test_each_distinct_build_runs_the_compiler_once(tmp_path):
    (tmp_path / "fake_cxx.py").write_text(FAKE_CXX)
    source = tmp_path / "op.cc"
    env = {**os.environ, "RR_TEST_CXX_CACHE": str(tmp_path / "cache")}

    def build(out, *flags):
        return subprocess.run([sys.executable, str(HERE / "cached_cxx.py"), sys.executable, str(tmp_path / "fake_cxx.py"),
                               str(source), *flags, "-o", str(tmp_path / out)], env=env).returncode

    def calls():
        return len((tmp_path / "calls").read_text().splitlines())

    source.write_text("one")
    assert [build("a.so"), build("b.so")] == [0, 0]
    assert calls() == 1, "the same build into another output ran the compiler again"
    assert (tmp_path / "a.so").read_text() == (tmp_path / "b.so").read_text() == "built from one"
    assert build("c.so", "-O0") == 0 and calls() == 2, "other flags are another build"
    source.write_text("two")
    assert build("d.so") == 0 and calls() == 3 and (tmp_path / "d.so").read_text() == "built from two"
    source.write_text("broken")
    assert [build("e.so"), build("e.so")] == [3, 3] and calls() == 5, "a failed compile is not cached"


def test_an_alone_test_overlaps_no_test_of_the_other_worker(tmp_path):
    for name in ("conftest.py", "ranks.py", "shm_leftovers.py", "world_pool.py", "cached_cxx.py"):
        shutil.copy(HERE / name, tmp_path / name)
    log = tmp_path / "log"
    (tmp_path / "test_a.py").write_text(textwrap.dedent(f"""
        import time, pytest
        @pytest.mark.alone
        @pytest.mark.parametrize("i", range(3))
        def test_alone(i):
            t0 = time.monotonic(); time.sleep(0.5)
            open({str(log)!r}, "a").write(f"alone {{t0}} {{time.monotonic()}}\\n")
    """))
    (tmp_path / "test_b.py").write_text(textwrap.dedent(f"""
        import time, pytest
        @pytest.mark.parametrize("i", range(8))
        def test_plain(i):
            t0 = time.monotonic(); time.sleep(0.3)
            open({str(log)!r}, "a").write(f"plain {{t0}} {{time.monotonic()}}\\n")
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "load",
                          "-o", "markers=alone: runs alone", str(tmp_path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    spans = {"alone": [], "plain": []}
    for line in log.read_text().splitlines():
        kind, start, end = line.split()
        spans[kind].append((float(start), float(end)))
    assert len(spans["alone"]) == 3 and len(spans["plain"]) == 8
    overlaps = [(a, p) for a in spans["alone"] for p in spans["plain"] if a[0] < p[1] and p[0] < a[1]]
    assert not overlaps, overlaps
    starts = sorted(s for s, _ in spans["plain"])
    assert any(later < earlier_end for (_, earlier_end), later in
               zip(sorted(spans["plain"]), starts[1:])), "the plain tests never ran side by side: not two workers"
