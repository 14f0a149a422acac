"""`rr.elastic`, `rr.compression`, `rr.tensorflow`, `rr.ray`: subpackages load
on first attribute access (PEP 562), as numpy's and scipy's do, and `import
ringreduce` never imports TensorFlow or Ray."""
import os
import subprocess
import sys

from ranks import REPO


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_subpackages_are_attributes_without_an_import_and_tensorflow_stays_unloaded():
    out = run_python("""
import sys
import ringreduce as rr
assert "tensorflow" not in sys.modules, "import ringreduce imported tensorflow"
assert "ringreduce.elastic" not in sys.modules, "the test must start with elastic not loaded"
assert callable(rr.elastic.run) and rr.elastic.ObjectState is not None
assert rr.compression.PowerSGD.__name__ == "PowerSGD"
assert "tensorflow" not in sys.modules, "rr.elastic / rr.compression imported tensorflow"
assert {"elastic", "compression", "tensorflow"} <= set(dir(rr))
try:
    rr.no_such_thing
except AttributeError as exc:
    assert "no_such_thing" in str(exc), exc
else:
    raise AssertionError("rr.no_such_thing did not raise AttributeError")
assert not hasattr(rr, "_private_name")
print("OK")
""")
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr


def test_rr_tensorflow_loads_the_tensorflow_layer_on_access():
    out = run_python("""
import sys
import ringreduce as rr
assert "tensorflow" not in sys.modules
hvd = rr.tensorflow
assert "tensorflow" in sys.modules and hvd is sys.modules["ringreduce.tensorflow"]
assert callable(hvd.allreduce)
print("OK")
""")
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr


def test_rr_ray_loads_ray_only_on_access():
    out = run_python("""
import sys
import ringreduce as rr
assert "ray" not in sys.modules, "import ringreduce imported ray"
assert "ray" in dir(rr)
import importlib.util
if importlib.util.find_spec("ray") is None:
    print("OK")  # without the ray extra there is nothing more to check
    raise SystemExit
executor = rr.ray.RayExecutor
assert "ray" in sys.modules and executor.__name__ == "RayExecutor"
assert "tensorflow" not in sys.modules, "rr.ray imported tensorflow"
print("OK")
""")
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr
