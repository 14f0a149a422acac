/* The transport interface the ring schedule runs on.
 *
 * A ring rank talks to two peers only: it sends to `next` (rank + 1) and
 * receives from `prev` (rank - 1), both at once. A transport is anything that
 * can move bytes that way (TCP sockets, MPI point-to-point); it knows nothing
 * of chunks, steps or dtypes, and the schedule knows nothing of sockets.
 */
#ifndef RINGREDUCE_TRANSPORT_H
#define RINGREDUCE_TRANSPORT_H

#include <stddef.h>

#include "common/error.h"

typedef struct rr_transport rr_transport;

typedef struct rr_transport_ops {
    /* Send up to slen bytes of sbuf to next and receive up to rlen bytes from
     * prev, at the same time. Blocks until at least one byte has moved either
     * way (*sent, *rcvd say how many), then returns RR_OK; or returns an error
     * code with err filled when a peer fails or stays silent past the
     * transport's timeout. Windows may be of any size: the ring's data steps
     * pass at most one pipeline segment, its blob exchange whole frames. */
    int (*exchange)(rr_transport *t, const void *sbuf, size_t slen, size_t *sent,
                    void *rbuf, size_t rlen, size_t *rcvd, rr_error *err);
    /* After an error: tell the other ranks (so none waits for a timeout) and
     * stop moving data. The transport is unusable afterwards. */
    void (*abort)(rr_transport *t, const rr_error *why);
    /* Orderly goodbye, then free everything. */
    void (*destroy)(rr_transport *t);
    /* Optional (NULL: nothing to check). An operation starts: fail now,
     * with err filled, if the transport already knows a peer is lost. */
    int (*begin)(rr_transport *t, rr_error *err);
    /* Optional (NULL: the transport reaches its ring neighbours only). For
     * algorithms that talk to any rank (recursive_doubling.c): sends nsend
     * whole messages to `peer` (sbufs[i], slens[i] bytes) while receiving
     * the next nrecv messages from it, each into a buffer malloc'ed here
     * (rbufs[i], rlens[i] bytes; the caller frees). Messages between two
     * ranks arrive in the order sent. At most RR_PEER_MSGS each way. Returns
     * RR_OK once every message has moved; or an error code with err filled
     * (and rbufs all NULL) when the peer fails or stays silent past the
     * transport's timeout plus depth * RR_BLAME_GRACE of it: depth counts the
     * waits the peer may itself be stuck in, so the rank that waits on the
     * one really silent blames it first, and its notice arrives in time. */
    int (*sendrecv)(rr_transport *t, int peer, int depth, const void *const *sbufs, const size_t *slens,
                    int nsend, void **rbufs, size_t *rlens, int nrecv, rr_error *err);
    /* Optional (NULL: the transport cannot judge waits it does not run). A
     * wait outside exchange() (the host arena, csrc/schedule/host_arena.h) has waited
     * waited_ms on rank waited_on: returns an error, with err filled, when a
     * peer is known lost or the wait has passed the transport's timeout.
     * Before it blames a rank (a neighbour's link seen closed, the timeout
     * passed) it asks arrived(arg) whether what the wait is for has come
     * after all: a peer may publish, finish and leave between two looks. */
    int (*stalled)(rr_transport *t, int waited_on, long long waited_ms, int (*arrived)(void *), void *arg,
                   rr_error *err);

    /* Optional (NULL: nothing to do). A ring operation starts; every rank
     * calls it at the same point of its stream (shared-memory links align
     * it there, see rr_shm_link_align_tx). */
    void (*align)(rr_transport *t);

    /* Optional (NULL: the timeout stays). How long a wait may see no
     * progress before the peer is judged silent, from the next wait on;
     * inf: never (a dead peer is still seen). Between operations only. */
    void (*set_timeout)(rr_transport *t, double timeout_s);

    /* Optional zero copy, for a transport whose both links are memory the
     * ring can address (shared-memory links); all five or none. The ring
     * then reduces straight out of the receive window and into the send
     * window instead of copying through buffers of its own.
     * rx_window: the contiguous bytes from prev readable now (*p, length;
     * 0: none yet), at most up to the end of the buffer (the rest comes in
     * the next window); rx_consume(n): hands n of them back. tx_window /
     * tx_commit: the same for room towards next. Windows of an operation
     * hold whole, aligned elements. wait: blocks until tx (rx) can move, or
     * returns an error as exchange() would (peer lost, silent, interrupt).
     * Bytes committed are counted by rr_transport_commit, not here. */
    size_t (*rx_window)(rr_transport *t, const void **p);
    void (*rx_consume)(rr_transport *t, size_t n);
    size_t (*tx_window)(rr_transport *t, void **p);
    void (*tx_commit)(rr_transport *t, size_t n);
    int (*wait)(rr_transport *t, int tx, int rx, rr_error *err);

    /* Optional (with the five above; NULL: no Cross Memory Attach path,
     * csrc/schedule/cma.c). Blocks until at most `most` of the bytes committed towards
     * next are still unread, or returns an error as wait() does. */
    int (*wait_drained)(rr_transport *t, size_t most, rr_error *err);
    /* With wait_drained. After reading prev's memory: RR_OK while prev is
     * still in the operation (its link open: a rank that gives up closes it
     * before it returns, so what was read before this check was its data);
     * else, or when the read itself failed (`failed` says how), the error
     * naming the rank really at fault, as a closed link is judged. */
    int (*prev_alive)(rr_transport *t, const char *failed, rr_error *err);
} rr_transport_ops;

#define RR_PEER_MSGS 2
#define RR_BLAME_GRACE 0.1

/* Asked while exchange() waits (see rr_should_stop): nonzero means give up,
 * e.g. the user pressed Ctrl-C. Set by the binding; the transport only calls
 * it, so it stays free of Python. */
typedef int (*rr_interrupt_hook)(void *arg);

/* What the bytes were for: the ring's data steps (allreduce, reduce_scatter,
 * allgather, broadcast), whole-frame blob exchanges (negotiation, small
 * allreduces), alltoall. */
enum { RR_SENT_RING = 0, RR_SENT_BLOBS = 1, RR_SENT_ALLTOALL = 2, RR_SENT_KINDS = 3 };

/* How the bytes went: a TCP socket, a shared-memory link (csrc/shm_link.c),
 * read by next out of this process by Cross Memory Attach (csrc/cma.c),
 * written once into this rank's host arena slot for every rank of the host
 * to read (csrc/host_arena.c), MPI point-to-point. Every byte counted in
 * sent[] is counted once in via[] too, so the two sum alike. */
enum { RR_VIA_TCP = 0, RR_VIA_SHM = 1, RR_VIA_CMA = 2, RR_VIA_ARENA = 3, RR_VIA_MPI = 4, RR_VIA_KINDS = 5 };

struct rr_transport {
    const rr_transport_ops *ops;
    int rank;
    int size;
    rr_interrupt_hook interrupted; /* NULL: never asked */
    void *interrupt_arg;
    /* Bytes this rank has sent (to next, or to any peer by sendrecv), by
     * what sent them (RR_SENT_*); only rr_transport_exchange and
     * rr_transport_sendrecv add to it. Transports allocate zeroed. */
    unsigned long long sent[RR_SENT_KINDS];
    /* The same bytes by how they went (RR_VIA_*), and how exchange, the
     * zero-copy windows and sendrecv send: set by the transport when it is
     * made (0: TCP). */
    unsigned long long via[RR_VIA_KINDS];
    int tx_via;
    /* Bytes of the others' data this rank has taken in, by how they came
     * (RR_VIA_*): from prev (exchange, the zero-copy windows, read out of
     * prev by CMA), from any peer (sendrecv), from the host arena's slots
     * of the other ranks (one slot written, counted sent once, is received
     * by every other rank of the host that reads it). rr_count_received. */
    unsigned long long received[RR_VIA_KINDS];
};

/* n bytes sent for `kind`, by way of `via`: the one place sent[] and via[] grow. */
static inline void rr_count_sent(rr_transport *t, int kind, int via, unsigned long long n)
{
    t->sent[kind] += n;
    t->via[via] += n;
}

/* n bytes of a peer's data taken in by way of `via`: the one place received[] grows. */
static inline void rr_count_received(rr_transport *t, int via, unsigned long long n) { t->received[via] += n; }

/* Every exchange goes through here, so what a rank sends is counted in one
 * place, whatever the transport (ringreduce.stats() reads it). */
static inline int rr_transport_exchange(rr_transport *t, int kind, const void *sbuf, size_t slen, size_t *sent,
                                        void *rbuf, size_t rlen, size_t *rcvd, rr_error *err)
{
    int rc = t->ops->exchange(t, sbuf, slen, sent, rbuf, rlen, rcvd, err);
    rr_count_sent(t, kind, t->tx_via, *sent);
    rr_count_received(t, t->tx_via, *rcvd);
    return rc;
}

/* The zero-copy sends go through here, counted as rr_transport_exchange counts. */
static inline void rr_transport_commit(rr_transport *t, int kind, size_t n)
{
    t->ops->tx_commit(t, n);
    rr_count_sent(t, kind, t->tx_via, n);
}

/* sendrecv's counterpart of rr_transport_exchange: what was sent and received is counted. */
static inline int rr_transport_sendrecv(rr_transport *t, int kind, int peer, int depth, const void *const *sbufs,
                                        const size_t *slens, int nsend, void **rbufs, size_t *rlens, int nrecv,
                                        rr_error *err)
{
    int rc = t->ops->sendrecv(t, peer, depth, sbufs, slens, nsend, rbufs, rlens, nrecv, err);
    if (rc == RR_OK) {
        for (int i = 0; i < nsend; i++) rr_count_sent(t, kind, t->tx_via, slens[i]);
        for (int i = 0; i < nrecv; i++) rr_count_received(t, t->tx_via, rlens[i]);
    }
    return rc;
}

/* How often a waiting transport asks the hook: a pending Ctrl-C is noticed
 * within this, and short waits never pay for the question. */
#define RR_INTERRUPT_CHECK_MS 100

/* For exchange()'s wait loop: asks the hook once *next_ms (a CLOCK_MONOTONIC
 * millisecond, first set RR_INTERRUPT_CHECK_MS after the wait began) has
 * passed. Returns RR_E_INTERRUPTED with err filled when it says stop. */
static inline int rr_should_stop(rr_transport *t, long long now_ms, long long *next_ms, rr_error *err)
{
    if (!t->interrupted || now_ms < *next_ms) return RR_OK;
    *next_ms = now_ms + RR_INTERRUPT_CHECK_MS;
    if (!t->interrupted(t->interrupt_arg)) return RR_OK;
    rr_set_error(err, RR_E_INTERRUPTED, t->rank, "rank %d was interrupted while waiting for its peers", t->rank);
    return err->code;
}

#endif
