"""The GPU check's benchmarks without a GPU (benchmarks/gpu_check.sh runs them on
one): their argument parsing, their markdown tables (an implementation that
did not run says n/a, never crashes the report; ratios and wrong results
show), and a --dry run end to end on two ranks, numpy standing in for cupy
and gloo on CPU tensors where torch is installed (n/a where not)."""
import os
import shutil
import subprocess
import sys

import pytest

from ranks import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_allreduce_bench as bench  # noqa: E402
import gpu_limits  # noqa: E402
import harness  # noqa: E402


def row(impl, nbytes, seconds, wrong=0, n=2):
    algbw = nbytes / seconds / 1e9
    return harness.Row(impl, "allreduce", nbytes, nbytes // 4, "float32", "sum", seconds, algbw,
                       algbw * harness.BUSBW_FACTOR["allreduce"](n), wrong, 0.0)


def test_the_sizes_and_switches_parse():
    args = bench.parse_args([])
    assert args.sizes == [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20] and not args.dry
    args = bench.parse_args(["--sizes", "4K,2M", "--dry", "--no-gloo", "--no-ipc"])
    assert args.sizes == [4096, 2 << 20] and args.dry and args.no_gloo and args.no_ipc
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "6"])  # not a whole number of float32


def test_the_table_gives_ratios_and_says_n_a_for_what_did_not_run():
    # staged at half numpy's busbw, IPC at twice staged's, no gloo; one wrong element at 1 MiB
    rows = [row("staged", 1 << 20, 2e-3), row("numpy", 1 << 20, 1e-3), row("ipc", 1 << 20, 1e-3, wrong=1),
            row("mixed", 1 << 20, 1e-3), row("staged", 64 << 10, 400e-6), row("numpy", 64 << 10, 100e-6)]
    text = bench.report(rows, "title", ["gloo: n/a (torch not importable)"])
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| size | rr cupy staged"))
    assert header.count("|") == len(bench.BUSBW_COLUMNS) + 7
    big = next(line for line in lines if line.startswith("| 1 MiB |") and "n/a" in line and line.count("|") > 8)
    cells = [c.strip() for c in big.strip("|").split("|")]
    head = [c.strip() for c in header.strip("|").split("|")]
    got = dict(zip(head, cells))
    assert got["gloo CUDA"] == "n/a" and got["staged/gloo"] == "n/a"
    assert got["staged/numpy"] == "0.50" and got["IPC/staged"] == "2.00" and got["mixed/numpy"] == "1.00"
    assert got["#wrong"] == "1"
    small = next(line for line in lines if line.startswith("| 64 KiB |") and line.count("|") > 8)
    assert "| n/a | n/a |" in small  # no IPC, no gloo at 64 KiB
    times = [line for line in lines if line.startswith("| 64 KiB |")][-1]
    assert "| 400.0 |" in times and "| 100.0 |" in times  # the latency, in us
    assert "WRONG RESULTS: ipc at 1 MiB: 1 elements" in text
    assert "gloo: n/a (torch not importable)" in text


def test_the_limits_table_runs_on_the_host_without_a_gpu(capsys):
    gpu_limits.main(["--dry", "--bytes", "1M", "--seconds", "0.01"])
    out = capsys.readouterr().out
    for name in ("D2H, pinned", "H2D, pinned", "D2H, pageable", "H2D, pageable", "device x += y", "device D2D copy"):
        line = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert float(line.split("|")[2]) > 0


def test_a_dry_run_on_two_ranks_prints_every_row_right():
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable,
                          str(REPO / "benchmarks" / "gpu_allreduce_bench.py"), "--dry", "--sizes", "64K,1M",
                          "--repeats", "1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line[line.index("|"):] for line in out.stdout.splitlines() if "|" in line]  # past ringrun's "[0] "
    rows = [line for line in lines if line.startswith(("| 64 KiB |", "| 1 MiB |"))]
    busbw = [line for line in rows if line.count("|") > 8]
    assert len(busbw) == 2, out.stdout
    for line in busbw:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert cells[-1] == "0", line  # no wrong element anywhere
        assert all(float(c) > 0 for c in cells[1:3] + cells[4:6]), line  # staged, IPC, numpy, mixed ran
    assert "WRONG" not in out.stdout


def test_the_benchmark_takes_its_time_limit_from_the_gpu_check_stage(monkeypatch):
    assert bench.parse_args([]).seconds == 0  # no limit
    monkeypatch.setenv("GPU_CHECK_STAGE_SECONDS", "100")
    assert bench.parse_args([]).seconds == 100 - bench.STARTUP_SECONDS
    assert bench.parse_args(["--seconds", "7"]).seconds == 7


def test_a_benchmark_short_of_time_leaves_sizes_out_and_still_prints_its_tables():
    """--seconds too short for more than the first size: every rank leaves
    the later sizes out alike (no hang, no mismatch), the tables print what
    ran, and a note names what was left out."""
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable,
                          str(REPO / "benchmarks" / "gpu_allreduce_bench.py"), "--dry", "--sizes", "64K,1M,16M",
                          "--repeats", "1", "--no-gloo", "--seconds", "0.001"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line[line.index("|"):] for line in out.stdout.splitlines() if "|" in line]
    shown = {line.split("|")[1].strip() for line in lines if line.split("|")[1].strip().endswith(("KiB", "MiB"))}
    assert shown == {"64 KiB"}, out.stdout
    assert "the staged phase left out 1 MiB, 16 MiB" in out.stdout, out.stdout
    assert "the ipc phase left out 64 KiB, 1 MiB, 16 MiB" in out.stdout, out.stdout
    assert "WRONG" not in out.stdout


def test_the_small_latency_breakdown_runs_its_host_row_without_a_gpu():
    """benchmarks/gpu_small_latency.py --dry on two ranks: the numpy row is
    measured and checked (#wrong 0), every GPU row says n/a."""
    out = subprocess.run([sys.executable, "-m", "ringreduce.launch.ringrun", "-np", "2", sys.executable,
                          str(REPO / "benchmarks" / "gpu_small_latency.py"), "--dry", "--iters", "50"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(tuple(c.strip() for c in line[line.index("|"):].strip().strip("|").split("|"))
                for line in out.stdout.splitlines() if "| " in line and "---" not in line and "what" not in line)
    assert float(rows["numpy"]) > 0, rows
    assert all(rows[k] == "n/a" for k in rows if k != "numpy") and len(rows) == 8, rows
    assert "#wrong: 0" in out.stdout


def test_the_gpu_check_keeps_to_its_time_budget():
    """benchmarks/gpu_check.sh with too little time for any stage: it prints
    its header, says each stage was skipped (never starts one it cannot
    finish), and exits with the number of stages not done."""
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_SECONDS": "5", "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# ringreduce GPU check") and any(line.startswith("$ ") for line in lines[:4])
    skipped = [line for line in lines if line.startswith("skipped: ")]
    stages = [line[3:] for line in lines if line.startswith("## ")]
    assert {"build", "limits", "tests", "tests-collectives", "bench-N2", "bench-N4", "latency-N2"} <= set(stages), stages
    assert len(skipped) == len(stages) == out.returncode, out.stdout
    assert lines[-1].startswith("# done in") and f"{len(stages)} stage(s) failed, timed out or skipped" in lines[-1]


@pytest.mark.slow
def test_a_dry_gpu_check_runs_every_stage_past_a_failing_one(tmp_path):
    """GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh end to end, in a copy of
    the checkout (no git there; its build in place touches nothing here)
    whose limits stage fails: the header names the machine and the
    versions, that stage says FAILED, every later stage still runs and
    prints its table, and the exit status counts the one failure."""
    tree = tmp_path / "tree"
    for name in ("csrc", "ringreduce", "scripts", "benchmarks", "tests"):
        shutil.copytree(REPO / name, tree / name, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.fatbin"))
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(REPO / name, tree / name)
    (tree / "benchmarks" / "gpu_limits.py").write_text("raise SystemExit(3)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MPICC", "RINGREDUCE_CUDA", "PYTHONPATH")}
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh"], capture_output=True, text=True, timeout=400, cwd=tree,
                         env={**env, "GPU_CHECK_DRY": "1", "PYTHON": sys.executable})
    text = out.stdout
    assert "commit unknown (no git checkout here)" in text, text[:2000]
    assert "python " in text and "numpy " in text and "ml_dtypes " in text and "setuptools " in text, text[:2000]
    stages = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert stages == ["build", "limits", "tests", "tests-collectives", "bench-N2", "bench-N4", "latency-N2"], stages
    assert "FAILED (exit 3): limits" in text
    assert text.count("| 256 MiB |") == 4, text[-4000:]  # both tables of both benchmarks
    assert "| numpy |" in text and "#wrong: 0" in text, text[-2000:]
    assert not any(line.startswith("skipped: ") for line in text.splitlines()), text[-4000:]  # no stage starved
    assert out.returncode == 1 and text.splitlines()[-1].endswith("1 stage(s) failed, timed out or skipped"), text[-2000:]
