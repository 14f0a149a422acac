"""TF1 graphs (a tf.compat.v1 Session) run independent ops in no fixed order,
so collectives there would pair different tensors across ranks, silently.
ringreduce refuses them clearly; eager code and tf.function keep working."""
import pytest

from ranks import run_ranks

pytest.importorskip("tensorflow", reason="tensorflow-cpu not installed (pip install 'ringreduce[tf]')")


def test_collectives_in_a_tf1_graph_are_refused_and_tf_function_still_works(tmp_path):
    ranks = run_ranks(2, """
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
        import ringreduce.tensorflow as rrtf
        rrtf.init()

        @tf.function
        def summed(a, b):  # two independent collectives: tf.function runs them in program order
            return rrtf.allreduce(a, op="sum"), rrtf.allreduce(b, op="sum")
        a, b = summed(tf.fill([5], float(rr.rank())), tf.fill([5], 10.0 * (rr.rank() + 1)))
        in_function = (a.numpy().tolist(), b.numpy().tolist())

        refused = []
        with tf.Graph().as_default():
            x = tf.constant([1.0, 2.0])
            for build in [lambda: rrtf.allreduce(x), lambda: rrtf.allgather(x), lambda: rrtf.broadcast(x, 0)]:
                try:
                    build()
                    refused.append("built")
                except RuntimeError as e:
                    refused.append(str(e))
        result = (in_function, refused)
    """, tmp_path, init=False, timeout=180)
    for r in ranks:
        in_function, refused = r.result
        assert in_function == ([1.0] * 5, [30.0] * 5), in_function
        for message in refused:
            assert "TF1 graph" in message and "pair different tensors" in message, message
