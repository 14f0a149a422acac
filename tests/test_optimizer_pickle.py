"""A DistributedOptimizer pickles (cloudpickle, Ray and multiprocessing users
need it) and comes back distributed, with its options."""
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")


def test_a_distributed_optimizer_pickles_and_comes_back_distributed(tmp_path):
    ranks = run_ranks(1, """
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import pickle, keras
        import ringreduce.tensorflow as rrtf
        rrtf.init()
        opt = rrtf.DistributedOptimizer(keras.optimizers.Adam(0.25), op=rrtf.Sum, backward_passes_per_step=2)
        back = pickle.loads(pickle.dumps(opt))
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=back, loss="mse")
        model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, epochs=1, verbose=0)
        result = (type(back).__name__, hasattr(back, "register_local_var"), float(back.learning_rate),
                  type(back)._rr_reduction is not None, int(back.iterations))
    """, tmp_path, init=False, timeout=120)
    name, distributed, lr, has_options, iterations = ranks[0].result
    assert name == "Adam" and distributed and has_options and lr == 0.25 and iterations == 2
