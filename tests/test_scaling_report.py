"""The training scaling harness (benchmarks/training_scaling.py): its stand-in
schedule, its compression option, the parameter server's compute stand-in, and
one tiny run end to end on loopback (no network namespaces needed)."""
import json
import subprocess
import sys
import threading

import pytest

from ranks import REPO, free_port

sys.path.insert(0, str(REPO / "benchmarks"))
import ps_baseline as ps  # noqa: E402
import training_scaling as ts  # noqa: E402


def test_schedule_splits_the_measured_times_by_each_layers_share():
    s = ts.stand_in_schedule([1.0, 3.0], [2.0, 6.0], fwd_total=0.4, fwd_bwd_total=1.2)
    assert s["fwd"] == pytest.approx([0.1, 0.3])
    assert s["bwd"] == pytest.approx([0.2, 0.6])
    assert sum(s["fwd"]) + sum(s["bwd"]) == pytest.approx(1.2)


def test_schedule_keeps_a_backward_when_the_whole_models_is_lost_in_noise():
    # CI once measured forward+backward no longer than forward alone (a tiny
    # model): the layers' own backward/forward ratio stands in, never zero.
    s = ts.stand_in_schedule([1.0, 3.0], [2.0, 6.0], fwd_total=0.4, fwd_bwd_total=0.39)
    assert s["bwd_s"] == pytest.approx(0.8) and s["bwd"] == pytest.approx([0.2, 0.6])


def test_compression_by_name_and_factory_with_keywords(monkeypatch):
    from ringreduce.tensorflow import Compression
    assert ts.compression_from("none") is Compression.none
    assert ts.compression_from("fp16") is Compression.fp16
    monkeypatch.setattr(Compression, "fake", staticmethod(lambda rank, ratio: ("fake", rank, ratio)), raising=False)
    assert ts.compression_from("fake:rank=4,ratio=0.01") == ("fake", 4, 0.01)
    with pytest.raises(ValueError, match="Compression.nosuch"):
        ts.compression_from("nosuch")


def test_ps_worker_counts_its_compute_stand_in_in_every_step():
    port, ready, iters = free_port(), threading.Event(), 3
    server = threading.Thread(target=ps.serve, args=(port, 1, 1000, iters, False, ready, "127.0.0.1"), daemon=True)
    server.start()
    assert ready.wait(10)
    out = ps.work([("127.0.0.1", port)], 1000, iters, compute_s=0.05)
    server.join(10)
    assert len(out["times"]) == iters and min(out["times"]) >= 0.05


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tiny_run_end_to_end_on_loopback(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "training_scaling.py"), "--quick", "--no-cluster",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=380)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "training_scaling.json").read_text(), object_hook=ts._int_keys)
    assert data["ns"] == [1, 2] and data["model"]["params"] == 64 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 10 + 10
    sched = data["schedule"]
    assert sum(sched["fwd"]) + sum(sched["bwd"]) == pytest.approx(0.2)  # --quick: measured shares of 0.2 s
    for mode in ("overlap", "no_overlap", "compressed"):
        for n in (1, 2):
            r = data["ring"][mode][n]
            assert r["weights_agree"], (mode, n)
            # the stand-ins really wait: no step is shorter than their sum
            assert min(r["step_times"]) >= 0.2, (mode, n, r["step_times"])
            assert r["samples_per_s"] == pytest.approx(n * 32 / r["step_s"])
    for key in ("ps_sync", "ps_async"):
        assert all(data[key][n]["samples_per_s"] > 0 for n in (1, 2))
        assert min(min(t) for t in data[key][2]["step_times"]) >= data["ps_compute_s"]
    assert ts.efficiency(data, data["ring"]["overlap"])[1] == 1.0
    # Overlap: the last layer's gradient is handed over while earlier layers
    # still "compute": well before backprop ends (without the per-layer
    # schedule every hand-over would come at its end).
    tail = sched["bwd_s"] - sched["bwd"][-1]
    t = data["ring"]["overlap"][2]["trace"]
    assert t["backprop_end_s"] - t["first_handover_s"] >= 0.5 * tail, t
    t = data["ring"]["no_overlap"][2]["trace"]
    assert t["backprop_end_s"] - t["first_handover_s"] < 0.5 * tail, t
    md = (tmp_path / "scaling.md").read_text()
    assert "## Training throughput" in md and "| 2 |" in md and (tmp_path / "scaling_training.png").stat().st_size
