"""A Horovod Keras script, unchanged but for its import line, on scikit-learn's digits.

    ringrun -np 2 python examples/horovod_keras_digits.py

The shape of Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py: scaled
learning rate, DistributedOptimizer, broadcast of rank 0's weights, metric
averaging, learning-rate warm-up, checkpoints and logs on rank 0 only.
"""
import os
import sys

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ringreduce.tensorflow.keras as hvd


def train(epochs, checkpoint_dir):
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin the GPU of this process's local rank (one GPU per process).
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target, test_size=0.25, random_state=0)
    # Horovod: each worker trains on its own shard.
    dataset = tf.data.Dataset.from_tensor_slices((x_train[hvd.rank()::hvd.size()],
                                                  y_train[hvd.rank()::hvd.size()]))
    dataset = dataset.repeat().shuffle(1000, seed=hvd.rank()).batch(32)

    model = tf.keras.Sequential([
        tf.keras.Input((64,)),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.2),
        tf.keras.layers.Dense(10, activation='softmax'),
    ])

    # Horovod: adjust learning rate based on number of workers.
    scaled_lr = 0.002 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=['accuracy'])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: warm the learning rate up to scaled_lr over the first epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, 'checkpoint-{epoch}.keras')))

    # Horovod: write logs on worker 0.
    verbose = 2 if hvd.rank() == 0 else 0

    # Horovod: adjust number of steps based on number of workers.
    model.fit(dataset, steps_per_epoch=1347 // 32 // hvd.size(), callbacks=callbacks, epochs=epochs, verbose=verbose)

    if hvd.rank() == 0:
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(f'test accuracy: {accuracy:.4f}')
    return model


if __name__ == '__main__':
    train(epochs=int(sys.argv[1]) if len(sys.argv) > 1 else 8,
          checkpoint_dir=sys.argv[2] if len(sys.argv) > 2 else '.')
