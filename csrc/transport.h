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

#include "error.h"

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
} rr_transport_ops;

struct rr_transport {
    const rr_transport_ops *ops;
    int rank;
    int size;
};

#endif
