/* MPI transport.
 *
 * The ring hands exchange() windows of whole pipeline segments, the same
 * segments on both ends of a link, so each window travels as one MPI
 * message: Isend for the send window, and for the receive window the next
 * message from prev, matched with MPI_Improbe and received straight into
 * place. A message larger than the window (a framed header, read in two
 * parts) is received once into a carry buffer and handed out piecewise.
 *
 * MPI has no poll(2): a waiting rank tests its requests and yields the core
 * between tests. A peer that makes no progress for the timeout is reported
 * as lost; a dead peer usually makes the MPI runtime end the job itself.
 */
#define _GNU_SOURCE
#include "mpi_transport.h"

#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING_TAG 0x5252 /* "RR" */

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
    int aborted;
} mpi_transport;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
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
    if (t->aborted) {
        rr_set_error(err, RR_E_PEER_LOST, -1, "transport was aborted after an earlier error");
        return err->code;
    }
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
    double deadline = now_s() + t->timeout_s;
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
        if (now_s() > deadline) {
            int waited_on = rlen ? t->prev : t->next;
            rr_set_error(err, RR_E_PEER_LOST, waited_on,
                         "lost rank %d: no progress for %.1f s (RINGREDUCE_TIMEOUT) over MPI", waited_on,
                         t->timeout_s);
            return err->code;
        }
        sched_yield();
    }
}

static void mpi_abort(rr_transport *base, const rr_error *why)
{
    mpi_transport *t = (mpi_transport *)base;
    (void)why;
    /* Requests still in flight cannot be taken back safely; the job is
     * failing, and the MPI runtime ends it when a rank exits. */
    t->aborted = 1;
}

static void mpi_destroy(rr_transport *base)
{
    mpi_transport *t = (mpi_transport *)base;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !t->aborted) MPI_Comm_free(&t->comm);
    free(t->carry);
    free(t);
}

static const rr_transport_ops mpi_ops = {mpi_exchange, mpi_abort, mpi_destroy};

rr_transport *rr_mpi_create(MPI_Comm comm, double timeout_s)
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
    t->base.ops = &mpi_ops;
    t->next = (t->base.rank + 1) % t->base.size;
    t->prev = (t->base.rank + t->base.size - 1) % t->base.size;
    t->timeout_s = timeout_s;
    return &t->base;
}
