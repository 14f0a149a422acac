"""Patterns of real Horovod training scripts that must keep working:
a gradient that is a constant, two tapes in one step, a scalar metric
allreduced, a mismatch error sent across processes."""
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")


def test_constant_gradients_two_tapes_and_scalars(tmp_path):
    ranks = run_ranks(2, """
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import pickle
        import tensorflow as tf
        import ringreduce.tensorflow as hvd
        hvd.init()
        r = hvd.rank()

        # A critic whose loss is linear in its output: the bias's gradient is a
        # constant (1/batch - 1/batch), the same every step.
        w, b = tf.Variable(tf.ones([3, 1])), tf.Variable(tf.zeros([1]))
        g_w = tf.Variable(tf.ones([3, 1]))          # a second model, a second tape
        @tf.function
        def step(real, fake):
            with tf.GradientTape() as t1:
                critic = tf.reduce_mean(fake @ w + b) - tf.reduce_mean(real @ w + b)
            with tf.GradientTape() as t2:
                gen = -tf.reduce_mean((fake @ g_w) @ tf.transpose(w))
            d1 = hvd.DistributedGradientTape(t1).gradient(critic, [w, b])
            d2 = hvd.DistributedGradientTape(t2).gradient(gen, [g_w])
            for v, g in zip([w, b, g_w], d1 + d2):
                v.assign_sub(0.1 * g)
            return critic
        for i in range(4):
            rng = np.random.default_rng(10 * i + r)
            step(tf.constant(rng.normal(size=(8, 3)), tf.float32), tf.constant(rng.normal(size=(8, 3)), tf.float32))
        weights = [v.numpy() for v in (w, b, g_w)]
        same = all(np.array_equal(x, rr.broadcast(x, root=0)) for x in weights)

        scalar_eager = hvd.allreduce(tf.constant(float(r)))
        scalar_fn = tf.function(lambda x: hvd.allreduce(x))(tf.constant(float(r)))
        e = hvd.MismatchError("tensor 'x' differs between ranks", 1)
        back = pickle.loads(pickle.dumps(e))
        result = (same, scalar_eager.shape.as_list(), float(scalar_eager), scalar_fn.numpy().shape,
                  back.message, isinstance(back, tf.errors.FailedPreconditionError))
    """, tmp_path, init=False, timeout=180, env={"RINGREDUCE_TIMEOUT": "30"})
    for r in ranks:
        same, eager_shape, eager_value, fn_shape, message, is_tf_error = r.result
        assert same, f"rank {r.rank}: weights differ across ranks"
        assert eager_shape == [] and eager_value == 0.5 and fn_shape == (), r.result
        assert message == "tensor 'x' differs between ranks" and is_tf_error


def test_broadcast_pairs_by_position_and_metrics_by_name(tmp_path):
    ranks = run_ranks(2, """
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import keras
        import ringreduce.tensorflow as hvd
        hvd.init()
        r = hvd.rank()
        if r == 0:  # rank 0 builds a probe first: its Keras names shift (dense_1, ...)
            keras.layers.Dense(2).build((None, 2))
        keras.utils.set_random_seed(r)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        hvd.broadcast_variables(model.variables, root_rank=0)
        weights = [w for w in model.get_weights()]
        same = all(np.array_equal(w, rr.broadcast(w, root=0)) for w in weights)
        logs = {"loss": float(r), "accuracy": 2.0 * r, "note": "text"}
        hvd.MetricAverageCallback().on_epoch_end(0, logs)
        result = (same, [v.path for v in model.variables][:1], logs)
    """, tmp_path, init=False, timeout=180, env={"RINGREDUCE_TIMEOUT": "30"})
    paths = {r.result[1][0] for r in ranks}
    assert len(paths) == 2, "the ranks' variable paths were meant to differ"
    for r in ranks:
        same, _, logs = r.result
        assert same, f"rank {r.rank}: broadcast_variables left different weights"
        assert logs == {"loss": 0.5, "accuracy": 1.0, "note": "text"}, logs
