/* What the files of ringreduce._core share (binding/): the Comm object, the
 * lock every operation runs under (RUN_LOCKED), and the functions module.c
 * puts in its method tables.
 *
 * Everything declared here is hidden: these names are the binding's own and
 * resolve inside _core, never to a symbol another library exports.
 */
#ifndef RINGREDUCE_BINDING_H
#define RINGREDUCE_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "schedule/ring.h"

#pragma GCC visibility push(hidden)

typedef struct {
    PyObject_HEAD
    rr_ring *ring;
    pthread_mutex_t mu;
    int mu_ready;        /* mu initialised: destroyed with the object, never while a thread may wait on it */
    int closed;
    rr_error broken; /* the first error; code RR_OK while healthy */
    PyObject *interrupt; /* what a signal handler raised while we waited (see signals_pending) */
    pid_t pid;           /* the process that made the ring: a forked child must not touch it */
    atomic_int busy;     /* an operation runs, on thread `owner` */
    atomic_int callers;  /* threads inside an operation's call, waiting for the mutex or running: Comm.busy */
    pthread_t owner;
    int close_pending;   /* close() came from a signal handler inside an operation: done after it */
    atomic_int stop_requested; /* interrupt() from any thread: the running operation gives up */
} CommObject;

extern PyTypeObject CommType;

/* comm.c: a Comm's life, and the checks every operation passes. */
/* This process's id, kept by an atfork handler: asking the kernel (getpid)
 * on every operation cost ~0.1 us of a 4 KiB allreduce's ~4. */
extern pid_t this_pid;

/* Records this process's id and keeps it across fork(); once, at import. */
void comm_track_pid(void);

static inline int forked_away(CommObject *self) { return self->pid != this_pid; }

/* A signal handler run by the hook is Python on the thread that holds the
 * lock: a collective or close() from it would wait for itself forever. */
static inline int reentered(CommObject *self)
{
    return atomic_load(&self->busy) && pthread_equal(self->owner, pthread_self());
}

int begin_op(CommObject *self, rr_error *err);
void close_ring(CommObject *self);

/* errors.c: rr_error to Python exceptions. */
PyObject *raise_error(const rr_error *err, int first);
PyObject *finish(CommObject *self, rr_error *err);
int check_usable(CommObject *self);
int refuse_closed(CommObject *self);

/* signals.c: what a waiting operation does about signals and interrupt(). */
void arm_interrupt(CommObject *self, int armed);
/* Records the main thread's id (only it runs signal handlers); once, at
 * import. -1 with an exception set on failure. */
int comm_find_main_thread(void);

/* Runs one ring operation with the GIL released and the lock held. A ring
 * that already knows a peer is lost fails before the operation starts
 * (rr_ring_begin); one called from a signal handler inside an operation, or
 * in a forked child, fails without touching the ring. */
#define RUN_LOCKED(self, err, CALL)                                          \
    do {                                                                     \
        if (reentered(self) || forked_away(self)) {                          \
            rr_set_error(&(err), RR_E_INVALID, -1, forked_away(self)         \
                ? "this communicator belongs to the process that forked this one: call ringreduce.init() here" \
                : "a collective cannot run inside a signal handler that interrupted another one");            \
            break;                                                           \
        }                                                                    \
        atomic_fetch_add(&(self)->callers, 1);                               \
        Py_BEGIN_ALLOW_THREADS                                               \
        pthread_mutex_lock(&(self)->mu);                                     \
        (self)->owner = pthread_self();                                      \
        atomic_store(&(self)->busy, 1);                                      \
        if (!(self)->ring) { /* closed by another thread while we waited */ \
            rr_set_error(&(err), RR_E_INVALID, -1, "ringreduce is shut down: call ringreduce.init() first"); \
        } else if ((self)->broken.code == RR_OK) {                           \
            arm_interrupt(self, 1);                                          \
            if (begin_op(self, &(err)) == RR_OK) { CALL; }                   \
            arm_interrupt(self, 0);                                          \
            if ((err).code != RR_OK) (self)->broken = (err);                 \
        } else {                                                             \
            (err) = (self)->broken;                                          \
            (err).code = -(err).code;                                        \
        }                                                                    \
        atomic_store(&(self)->busy, 0);                                      \
        pthread_mutex_unlock(&(self)->mu);                                   \
        Py_END_ALLOW_THREADS                                                 \
        atomic_fetch_sub(&(self)->callers, 1);                               \
        if ((self)->close_pending) close_ring(self);                         \
    } while (0)

static inline int get_writable(PyObject *obj, Py_buffer *view)
{
    return PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
}

static inline int valid_dtype_op(int dtype, int op)
{
    if (dtype < 0 || dtype >= RR_NUM_DTYPES || op < 0 || op >= RR_NUM_OPS) {
        PyErr_SetString(PyExc_ValueError, "unknown dtype or op code");
        return 0;
    }
    return 1;
}

/* The methods module.c lists, by the file that holds them. */
/* comm.c */
int Comm_init(CommObject *self, PyObject *args, PyObject *kw);
void Comm_dealloc(CommObject *self);
PyObject *Comm_close(CommObject *self, PyObject *ignored);
PyObject *Comm_interrupt(CommObject *self, PyObject *ignored);
PyObject *Comm_set_timeout(CommObject *self, PyObject *args);
PyObject *Comm_get_busy(CommObject *self, void *closure);
PyObject *Comm_get_broken(CommObject *self, void *closure);
/* collectives.c */
PyObject *Comm_allreduce(CommObject *self, PyObject *args);
PyObject *Comm_reduce_scatter(CommObject *self, PyObject *args);
PyObject *Comm_allgather(CommObject *self, PyObject *args);
PyObject *Comm_broadcast(CommObject *self, PyObject *args);
PyObject *Comm_alltoall(CommObject *self, PyObject *args);
PyObject *Comm_allreduce_device(CommObject *self, PyObject *args);
PyObject *Comm_allreduce_ipc(CommObject *self, PyObject *args);
PyObject *Comm_allreduce_small_ipc(CommObject *self, PyObject *args);
PyObject *Comm_release_ipc(CommObject *self, PyObject *args);
PyObject *Comm_get_ring_id(CommObject *self, void *closure);
PyObject *Comm_reduce_scatter_ipc(CommObject *self, PyObject *args);
PyObject *Comm_allgather_ipc(CommObject *self, PyObject *args);
PyObject *Comm_broadcast_ipc(CommObject *self, PyObject *args);
PyObject *Comm_reduce_scatter_device(CommObject *self, PyObject *args);
PyObject *Comm_allgather_device(CommObject *self, PyObject *args);
PyObject *Comm_broadcast_device(CommObject *self, PyObject *args);
PyObject *Comm_exchange_blobs(CommObject *self, PyObject *args);
PyObject *Comm_allreduce_small(CommObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Comm_try_allreduce_small(CommObject *self, PyObject *const *args, Py_ssize_t nargs);
/* tuning.c */
PyObject *Comm_set_segment(CommObject *self, PyObject *args);
PyObject *Comm_set_small_algorithm(CommObject *self, PyObject *args);
PyObject *Comm_get_small_algorithm(CommObject *self, void *closure);
PyObject *Comm_get_small_rounds(CommObject *self, void *closure);
PyObject *Comm_attach_arena(CommObject *self, PyObject *args);
PyObject *Comm_use_arena(CommObject *self, PyObject *args);
PyObject *Comm_get_arena_slot(CommObject *self, void *closure);
PyObject *Comm_set_zero_copy(CommObject *self, PyObject *args);
PyObject *Comm_get_zero_copy(CommObject *self, void *closure);
PyObject *Comm_set_cma(CommObject *self, PyObject *args);
PyObject *Comm_cma_probe(PyObject *cls, PyObject *args);
PyObject *Comm_get_cma_pid(CommObject *self, void *closure);
PyObject *core_kernels16(PyObject *m, PyObject *args);
PyObject *core_arena_file_bytes(PyObject *m, PyObject *args);
/* counters.c */
PyObject *Comm_bytes(CommObject *self, PyObject *ignored);
PyObject *Comm_bytes_via(CommObject *self, PyObject *ignored);
PyObject *Comm_bytes_received(CommObject *self, PyObject *ignored);
PyObject *Comm_cma_ops(CommObject *self, PyObject *ignored);
PyObject *Comm_mapped_ops(CommObject *self, PyObject *ignored);
PyObject *Comm_zero_copy_ops(CommObject *self, PyObject *ignored);
PyObject *Comm_last_phases(CommObject *self, PyObject *ignored);
/* kernels.c */
PyObject *core_reduce(PyObject *m, PyObject *args);
PyObject *core_mean_fold(PyObject *m, PyObject *args);
PyObject *core_divide(PyObject *m, PyObject *args);

#pragma GCC visibility pop

#endif
