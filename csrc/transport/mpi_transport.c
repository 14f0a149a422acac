/* MPI transport.
 *
 * The ring hands exchange() windows of whole pipeline segments, the same
 * segments on both ends of a link, so each window travels as one MPI
 * message: Isend for the send window, and for the receive window the next
 * message from prev, matched with MPI_Improbe and received straight into
 * place. A message larger than the window (a framed header, read in two
 * parts) is received once into a carry buffer and handed out piecewise.
 *
 * MPI has no poll(2), and MPICH's blocking waits spin: a waiting rank tests
 * its requests, yielding the core between tests for the first millisecond
 * (back-to-back messages keep their latency), then sleeping between tests
 * with naps that grow to a millisecond (a late peer costs almost no CPU).
 * While it sleeps it also asks the interrupt hook (Ctrl-C) and looks for
 * failure notices.
 *
 * Any rank (sendrecv, for recursive doubling): whole messages to and from
 * one peer, on their own tag so they never meet the ring's. The receiver
 * probes for each message's size, allocates it, and receives it in place.
 * The wait is the ring's: yield, then nap, asking for notices.
 *
 * The host arena (all ranks on one host, csrc/schedule/host_arena.h) waits outside
 * MPI: it asks stalled() between its sleeps, which looks for notices and
 * applies the timeout.
 *
 * Failure: a rank that gives up (an error, a timeout, an interrupt) sends a
 * notice, {rank to blame, error code}, to every rank (a doubling partner
 * waiting on it need not be a neighbour), and those that hear it give up in
 * turn and pass it on, so the whole ring learns promptly who left. A peer
 * that makes no progress for the timeout is reported as lost; a dead peer
 * usually makes the MPI runtime end the job itself. A rank that gives up
 * first settles its requests (MPICH cannot cancel a send: the receiver takes
 * and drops it), so no MPI call touches the caller's buffers once the
 * operation has returned.
 */
#define _GNU_SOURCE
#include "transport/mpi_transport.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define RING_TAG 0x5252   /* "RR" */
#define NOTICE_TAG 0x5253 /* a failure notice: int[2] = {rank to blame, RR_E_* code} */
#define PEER_TAG 0x5254   /* sendrecv's messages, to and from any rank */

#define SPIN_S 1e-3       /* yield between tests this long, then sleep */
#define NAP_MIN_NS 10000L
#define NAP_MAX_NS 1000000L
#define SETTLE_S 2.0      /* how long abort waits for its requests to finish */

typedef struct {
    rr_transport base;
    MPI_Comm comm;
    int next, prev;
    double timeout_s;
    MPI_Request sreq, rreq;
    const void *spending; /* window of the pending send, NULL if none */
    size_t spending_len;
    void *rpending;       /* window of the pending receive */
    int rpending_len;
    char *carry;          /* bytes of a message larger than its window */
    size_t carry_len, carry_off, carry_cap;
    /* Failure notices: a receive posted for prev's, next's and anyone
     * else's; ours go to every rank (notice_sreq[size]). */
    int notice_in[3][2], notice_out[2];
    MPI_Request notice_rreq[3], *notice_sreq;
    /* sendrecv's requests; after an error they stay here for settle(). */
    MPI_Request peer_sreq[RR_PEER_MSGS], peer_rreq;
    void *peer_rbuf;      /* the buffer of a pending peer receive (ours, freed once it settles) */
    void *stale_rbuf;     /* one released to MPI unfinished: freed only at destroy */
    char *drop;           /* where abort drains messages nobody will read */
    size_t drop_cap;
    int aborted;
    int *pids;            /* every rank's process, NULL unless all share our pid namespace */
} mpi_transport;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Sleeps a growing nap; *nap_ns 0 starts over. */
static void nap(long *nap_ns)
{
    *nap_ns = *nap_ns ? (*nap_ns * 2 < NAP_MAX_NS ? *nap_ns * 2 : NAP_MAX_NS) : NAP_MIN_NS;
    struct timespec ts = {0, *nap_ns};
    nanosleep(&ts, NULL);
}

/* A neighbour gave up and said whom to blame: so do we. */
static int notice_received(mpi_transport *t, rr_error *err)
{
    for (int i = 0; i < 3; i++) {
        int done = 0;
        MPI_Status st;
        if (t->notice_rreq[i] == MPI_REQUEST_NULL) continue;
        if (MPI_Test(&t->notice_rreq[i], &done, &st) != MPI_SUCCESS || !done) continue;
        int culprit = t->notice_in[i][0], from = i == 0 ? t->prev : i == 1 ? t->next : st.MPI_SOURCE;
        if (culprit < 0 || culprit >= t->base.size) culprit = from;
        const char *why = t->notice_in[i][1] == RR_E_INTERRUPTED ? "it was interrupted" : "it failed";
        if (culprit == t->base.rank)
            rr_set_error(err, RR_E_PEER_LOST, culprit, "rank %d gave up waiting on this rank (%d) and left the ring "
                         "(over MPI)", from, culprit);
        else if (culprit == from)
            rr_set_error(err, RR_E_PEER_LOST, culprit, "lost rank %d: %s and left the ring (over MPI)", culprit, why);
        else
            rr_set_error(err, RR_E_PEER_LOST, culprit, "lost rank %d: %s and left the ring (over MPI, told by rank %d)",
                         culprit, why, from);
        return err->code;
    }
    return RR_OK;
}

static int mpi_failed(mpi_transport *t, int rc, const char *what, rr_error *err)
{
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    rr_set_error(err, RR_E_PEER_LOST, -1, "MPI %s failed: %.*s", what, len, text);
    (void)t;
    return err->code;
}

static int mpi_exchange(rr_transport *base, const void *sbuf, size_t slen, size_t *sent,
                        void *rbuf, size_t rlen, size_t *rcvd, rr_error *err)
{
    mpi_transport *t = (mpi_transport *)base;
    *sent = *rcvd = 0;
    if (t->aborted) return rr_aborted_error(err);
    if (slen == 0 && rlen == 0) return RR_OK;
    if (slen > INT32_MAX || rlen > INT32_MAX) {
        rr_set_error(err, RR_E_INVALID, -1, "window of more than 2 GiB");
        return err->code;
    }
    if (rlen && t->carry_off < t->carry_len) { /* rest of an oversized message */
        size_t n = t->carry_len - t->carry_off < rlen ? t->carry_len - t->carry_off : rlen;
        memcpy(rbuf, t->carry + t->carry_off, n);
        t->carry_off += n;
        *rcvd = n;
        return RR_OK;
    }
    int rc;
    if (slen && !t->spending) {
        rc = MPI_Isend(sbuf, (int)slen, MPI_BYTE, t->next, RING_TAG, t->comm, &t->sreq);
        if (rc != MPI_SUCCESS) return mpi_failed(t, rc, "Isend", err);
        t->spending = sbuf;
        t->spending_len = slen;
    }
    const double start = now_s(), deadline = start + t->timeout_s;
    long long next_check = (long long)(start * 1000) + RR_INTERRUPT_CHECK_MS;
    long nap_ns = 0;
    for (;;) {
        if (rlen && !t->rpending) {
            int flag = 0, count = 0;
            MPI_Message msg;
            MPI_Status st;
            rc = MPI_Improbe(t->prev, RING_TAG, t->comm, &flag, &msg, &st);
            if (rc != MPI_SUCCESS) return mpi_failed(t, rc, "Improbe", err);
            if (flag) {
                MPI_Get_count(&st, MPI_BYTE, &count);
                if ((size_t)count <= rlen) {
                    rc = MPI_Imrecv(rbuf, count, MPI_BYTE, &msg, &t->rreq);
                    if (rc != MPI_SUCCESS) return mpi_failed(t, rc, "Imrecv", err);
                    t->rpending = rbuf;
                    t->rpending_len = count;
                } else {
                    if ((size_t)count > t->carry_cap) {
                        char *grown = realloc(t->carry, (size_t)count);
                        if (!grown) {
                            rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
                            return err->code;
                        }
                        t->carry = grown;
                        t->carry_cap = (size_t)count;
                    }
                    rc = MPI_Mrecv(t->carry, count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
                    if (rc != MPI_SUCCESS) return mpi_failed(t, rc, "Mrecv", err);
                    memcpy(rbuf, t->carry, rlen);
                    t->carry_len = (size_t)count;
                    t->carry_off = rlen;
                    *rcvd = rlen;
                }
            }
        }
        if (t->spending) {
            int done = 0;
            rc = MPI_Test(&t->sreq, &done, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) return mpi_failed(t, rc, "Test (send)", err);
            if (done) {
                *sent = t->spending_len;
                t->spending = NULL;
            }
        }
        if (t->rpending) {
            int done = 0;
            rc = MPI_Test(&t->rreq, &done, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) return mpi_failed(t, rc, "Test (receive)", err);
            if (done) {
                *rcvd = (size_t)t->rpending_len;
                t->rpending = NULL;
            }
        }
        if (*sent || *rcvd) return RR_OK;
        const double now = now_s();
        if (now > deadline) {
            int waited_on = rlen ? t->prev : t->next;
            rr_set_error(err, RR_E_PEER_LOST, waited_on,
                         "lost rank %d: no progress for %.1f s (RINGREDUCE_TIMEOUT) over MPI", waited_on,
                         t->timeout_s);
            return err->code;
        }
        if (now - start < SPIN_S) {
            sched_yield();
            continue;
        }
        if ((rc = notice_received(t, err)) != RR_OK) return rc;
        if ((rc = rr_should_stop(base, (long long)(now * 1000), &next_check, err)) != RR_OK) return rc;
        nap(&nap_ns);
    }
}

/* Waits like exchange(): yields for SPIN_S, then naps, asking for notices
 * and the interrupt hook. RR_OK: wait again. *start restarts on progress;
 * the peer is blamed after the timeout and depth graces (transport.h), unless
 * a notice names someone else first. */
static int wait_a_little(mpi_transport *t, int peer, int depth, double *start, long long *next_check, long *nap_ns,
                         rr_error *err)
{
    const double now = now_s();
    if (now > *start + t->timeout_s * (1 + depth * RR_BLAME_GRACE)) {
        if (notice_received(t, err) != RR_OK) return err->code;
        rr_set_error(err, RR_E_PEER_LOST, peer, "lost rank %d: no progress for %.1f s (RINGREDUCE_TIMEOUT) over MPI",
                     peer, t->timeout_s);
        return err->code;
    }
    if (now - *start < SPIN_S) {
        sched_yield();
        return RR_OK;
    }
    int rc;
    if ((rc = notice_received(t, err)) != RR_OK) return rc;
    if ((rc = rr_should_stop(&t->base, (long long)(now * 1000), next_check, err)) != RR_OK) return rc;
    nap(nap_ns);
    return RR_OK;
}

static int mpi_sendrecv(rr_transport *base, int peer, int depth, const void *const *sbufs, const size_t *slens,
                        int nsend, void **rbufs, size_t *rlens, int nrecv, rr_error *err)
{
    mpi_transport *t = (mpi_transport *)base;
    for (int i = 0; i < nrecv; i++) rbufs[i] = NULL;
    if (t->aborted) return rr_aborted_error(err);
    if (nsend > RR_PEER_MSGS || nrecv > RR_PEER_MSGS || peer < 0 || peer >= base->size || peer == base->rank) {
        rr_set_error(err, RR_E_INVALID, -1, "sendrecv: bad peer %d or message count", peer);
        return err->code;
    }
    int rc;
    for (int i = 0; i < nsend; i++) {
        if (slens[i] > INT32_MAX) {
            rr_set_error(err, RR_E_INVALID, -1, "message of more than 2 GiB");
            return err->code;
        }
        rc = MPI_Isend(sbufs[i], (int)slens[i], MPI_BYTE, peer, PEER_TAG, t->comm, &t->peer_sreq[i]);
        if (rc != MPI_SUCCESS) return mpi_failed(t, rc, "Isend", err);
    }
    double start = now_s();
    long long next_check = (long long)(start * 1000) + RR_INTERRUPT_CHECK_MS;
    long nap_ns = 0;
    int got = 0, sends_done = 0;
    for (;;) {
        int progress = 0;
        if (got < nrecv && !t->peer_rbuf) { /* the next message: its size, then the message itself */
            int flag = 0, count = 0;
            MPI_Message msg;
            MPI_Status st;
            rc = MPI_Improbe(peer, PEER_TAG, t->comm, &flag, &msg, &st);
            if (rc != MPI_SUCCESS) goto mpi_error;
            if (flag) {
                MPI_Get_count(&st, MPI_BYTE, &count);
                if (!(t->peer_rbuf = malloc(count ? (size_t)count : 1))) {
                    rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
                    goto failed;
                }
                rc = MPI_Imrecv(t->peer_rbuf, count, MPI_BYTE, &msg, &t->peer_rreq);
                if (rc != MPI_SUCCESS) goto mpi_error;
                rlens[got] = (size_t)count;
            }
        }
        if (t->peer_rbuf) {
            int done = 0;
            rc = MPI_Test(&t->peer_rreq, &done, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) goto mpi_error;
            if (done) {
                rbufs[got++] = t->peer_rbuf;
                t->peer_rbuf = NULL;
                progress = 1;
            }
        }
        if (!sends_done) {
            rc = MPI_Testall(nsend, t->peer_sreq, &sends_done, MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS) goto mpi_error;
            progress |= sends_done;
        }
        if (sends_done && got == nrecv) return RR_OK;
        if (progress) {
            start = now_s();
            nap_ns = 0;
            continue;
        }
        if ((rc = wait_a_little(t, peer, depth, &start, &next_check, &nap_ns, err)) != RR_OK) goto failed;
    }
mpi_error:
    mpi_failed(t, rc, "sendrecv", err);
failed:
    for (int i = 0; i < got; i++) {
        free(rbufs[i]);
        rbufs[i] = NULL;
    }
    return err->code; /* pending requests stay for settle() */
}

/* Takes and drops a message from prev that nobody will read (MPICH cannot
 * cancel a send: this lets prev's complete). */
static void drain_one(mpi_transport *t)
{
    int flag = 0, count = 0;
    MPI_Message msg;
    MPI_Status st;
    if (MPI_Improbe(t->prev, RING_TAG, t->comm, &flag, &msg, &st) != MPI_SUCCESS || !flag)
        if (MPI_Improbe(MPI_ANY_SOURCE, PEER_TAG, t->comm, &flag, &msg, &st) != MPI_SUCCESS || !flag) return;
    MPI_Get_count(&st, MPI_BYTE, &count);
    if ((size_t)count > t->drop_cap) {
        char *grown = realloc(t->drop, (size_t)count);
        if (grown) {
            t->drop = grown;
            t->drop_cap = (size_t)count;
        }
    }
    /* Blocking is safe: the message is matched and its sender is progressing
     * (it is in a collective, or settling its own requests). */
    MPI_Mrecv(count <= (int)t->drop_cap ? t->drop : NULL, count <= (int)t->drop_cap ? count : 0, MPI_BYTE, &msg,
              MPI_STATUS_IGNORE);
}

/* Waits up to `seconds` for every request on a caller's buffer to finish,
 * draining what prev sent meanwhile. What is still pending after that (a
 * neighbour that makes no MPI calls at all) is released to MPI: it finishes
 * on its own, on memory the caller may have freed. */
static int notices_pending(const mpi_transport *t)
{
    for (int i = 0; i < t->base.size; i++)
        if (t->notice_sreq[i] != MPI_REQUEST_NULL) return 1;
    return 0;
}

static int peer_pending(const mpi_transport *t)
{
    for (int i = 0; i < RR_PEER_MSGS; i++)
        if (t->peer_sreq[i] != MPI_REQUEST_NULL) return 1;
    return t->peer_rbuf != NULL;
}

static void settle(mpi_transport *t, double seconds)
{
    const double end = now_s() + seconds;
    long nap_ns = 0;
    while (t->spending || t->rpending || notices_pending(t) || peer_pending(t)) {
        int done = 0;
        for (int i = 0; i < RR_PEER_MSGS; i++)
            if (t->peer_sreq[i] != MPI_REQUEST_NULL) MPI_Test(&t->peer_sreq[i], &done, MPI_STATUS_IGNORE);
        if (t->peer_rbuf && (MPI_Test(&t->peer_rreq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done)) {
            free(t->peer_rbuf);
            t->peer_rbuf = NULL;
        }
        if (t->spending && (MPI_Test(&t->sreq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done)) t->spending = NULL;
        if (t->rpending && (MPI_Test(&t->rreq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done)) t->rpending = NULL;
        for (int i = 0; i < t->base.size; i++)
            if (t->notice_sreq[i] != MPI_REQUEST_NULL) MPI_Test(&t->notice_sreq[i], &done, MPI_STATUS_IGNORE);
        drain_one(t);
        if (now_s() > end) break;
        nap(&nap_ns);
    }
    if (t->spending) MPI_Request_free(&t->sreq);
    if (t->rpending) MPI_Request_free(&t->rreq);
    for (int i = 0; i < RR_PEER_MSGS; i++)
        if (t->peer_sreq[i] != MPI_REQUEST_NULL) MPI_Request_free(&t->peer_sreq[i]);
    if (t->peer_rbuf) {
        MPI_Request_free(&t->peer_rreq); /* it may still land: its buffer is kept until destroy */
        t->stale_rbuf = t->peer_rbuf;
        t->peer_rbuf = NULL;
    }
    for (int i = 0; i < t->base.size; i++)
        if (t->notice_sreq[i] != MPI_REQUEST_NULL) MPI_Request_free(&t->notice_sreq[i]);
    t->spending = NULL;
    t->rpending = NULL;
}

static void mpi_abort(rr_transport *base, const rr_error *why)
{
    mpi_transport *t = (mpi_transport *)base;
    if (t->aborted) return;
    t->aborted = 1;
    t->notice_out[0] = why && why->rank >= 0 ? why->rank : t->base.rank;
    t->notice_out[1] = why ? why->code : RR_E_PEER_LOST;
    for (int i = 0; i < t->base.size; i++) /* tell everyone whom to blame */
        if (i != t->base.rank) MPI_Isend(t->notice_out, 2, MPI_INT, i, NOTICE_TAG, t->comm, &t->notice_sreq[i]);
    settle(t, t->timeout_s < SETTLE_S ? t->timeout_s : SETTLE_S);
}

static void mpi_destroy(rr_transport *base)
{
    mpi_transport *t = (mpi_transport *)base;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        settle(t, SETTLE_S); /* nothing pending after a finished operation */
        for (int i = 0; i < 3; i++) {
            if (t->notice_rreq[i] == MPI_REQUEST_NULL) continue;
            MPI_Cancel(&t->notice_rreq[i]); /* an unmatched receive: cancels at once */
            MPI_Wait(&t->notice_rreq[i], MPI_STATUS_IGNORE);
        }
        if (!t->aborted) MPI_Comm_free(&t->comm);
    }
    free(t->carry);
    free(t->drop);
    free(t->stale_rbuf);
    free(t->notice_sreq);
    free(t->pids);
    free(t);
}

/* Whether process pid has died: gone, or a zombie its parent (the MPI
 * launcher's proxy) has not reaped yet. */
static int process_dead(int pid)
{
    if (kill(pid, 0) != 0) return errno == ESRCH; /* EPERM: someone's, alive */
    char path[48], text[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT;
    const ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0) return 0;
    text[n] = 0;
    const char *state = strrchr(text, ')'); /* "pid (comm) S ...": comm may hold anything but the last ')' */
    return state && (state[2] == 'Z' || state[2] == 'X');
}

/* A wait in the host arena (csrc/schedule/host_arena.h), judged as exchange() judges
 * its own: a failure notice names whom to blame, and the rank waited on is
 * lost once its process has died (seen through its pid: the ranks share a
 * host) or once silent past the timeout, unless its part came meanwhile (it
 * may publish, finish and leave between two looks). The MPI launcher may
 * end the whole job first when a process dies (Hydra does by default): then
 * it is the launcher's report that names the dead process. */
static int mpi_stalled(rr_transport *base, int waited_on, long long waited_ms, int (*arrived)(void *), void *arg,
                       rr_error *err)
{
    mpi_transport *t = (mpi_transport *)base;
    if (t->aborted) return rr_aborted_error(err);
    int rc = notice_received(t, err);
    if (rc != RR_OK) return rc;
    if (t->pids && waited_on >= 0 && waited_on < base->size && process_dead(t->pids[waited_on]) && !arrived(arg)) {
        rr_set_error(err, RR_E_PEER_LOST, waited_on, "lost rank %d: its process (pid %d) died (over MPI, in the "
                     "host arena)", waited_on, t->pids[waited_on]);
        return err->code;
    }
    if ((double)waited_ms >= t->timeout_s * 1000.0 && !arrived(arg)) {
        rr_set_error(err, RR_E_PEER_LOST, waited_on, "lost rank %d: no progress for %.1f s (RINGREDUCE_TIMEOUT) in "
                     "the host arena (over MPI)", waited_on, t->timeout_s);
        return err->code;
    }
    return RR_OK;
}

static void mpi_set_timeout(rr_transport *base, double timeout_s)
{
    ((mpi_transport *)base)->timeout_s = timeout_s;
}

static const rr_transport_ops mpi_ops = {
    .exchange = mpi_exchange, .abort = mpi_abort, .destroy = mpi_destroy, .sendrecv = mpi_sendrecv,
    .stalled = mpi_stalled, .set_timeout = mpi_set_timeout};

rr_transport *rr_mpi_create(MPI_Comm comm, double timeout_s, const int *pids)
{
    mpi_transport *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    if (MPI_Comm_dup(comm, &t->comm) != MPI_SUCCESS) {
        free(t);
        return NULL;
    }
    MPI_Comm_set_errhandler(t->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(t->comm, &t->base.rank);
    MPI_Comm_size(t->comm, &t->base.size);
    t->base.tx_via = RR_VIA_MPI;
    t->base.ops = &mpi_ops;
    t->next = (t->base.rank + 1) % t->base.size;
    t->prev = (t->base.rank + t->base.size - 1) % t->base.size;
    t->timeout_s = timeout_s;
    if (!(t->notice_sreq = malloc(sizeof *t->notice_sreq * (size_t)t->base.size))) {
        MPI_Comm_free(&t->comm);
        free(t);
        return NULL;
    }
    if (pids && (t->pids = malloc(sizeof *t->pids * (size_t)t->base.size)))
        memcpy(t->pids, pids, sizeof *t->pids * (size_t)t->base.size); /* none: the timeout still holds */
    for (int i = 0; i < t->base.size; i++) t->notice_sreq[i] = MPI_REQUEST_NULL;
    for (int i = 0; i < 3; i++) t->notice_rreq[i] = MPI_REQUEST_NULL;
    for (int i = 0; i < RR_PEER_MSGS; i++) t->peer_sreq[i] = MPI_REQUEST_NULL;
    if (t->base.size > 1) {
        MPI_Irecv(t->notice_in[0], 2, MPI_INT, t->prev, NOTICE_TAG, t->comm, &t->notice_rreq[0]);
        MPI_Irecv(t->notice_in[1], 2, MPI_INT, t->next, NOTICE_TAG, t->comm, &t->notice_rreq[1]);
        MPI_Irecv(t->notice_in[2], 2, MPI_INT, MPI_ANY_SOURCE, NOTICE_TAG, t->comm, &t->notice_rreq[2]);
    }
    return &t->base;
}
