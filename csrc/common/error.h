/* The error record every layer of the C core fills (ring, kernels' callers,
 * transports, devices): a code, the rank at fault and a message. Its own
 * header so that code reporting errors needs nothing of the wire. */
#ifndef RINGREDUCE_ERROR_H
#define RINGREDUCE_ERROR_H

enum {
    RR_OK = 0,
    RR_E_PEER_LOST = 1, /* a peer died, closed, or stayed silent too long */
    RR_E_PROTOCOL = 2,  /* bytes on the wire that make no sense */
    RR_E_SYSTEM = 3,    /* out of memory, a failed system call */
    RR_E_INVALID = 4,   /* bad arguments */
    RR_E_DEVICE = 5,    /* the accelerator failed (a CUDA call) */
    RR_E_INTERRUPTED = 6, /* the interrupt hook said stop (Ctrl-C); rank: this one */
};

typedef struct rr_error {
    int code;
    int rank;       /* the rank at fault (the lost peer for RR_E_PEER_LOST), or -1 */
    char msg[256];
} rr_error;

/* Fills err unless it already holds an error: the first cause wins. */
void rr_set_error(rr_error *err, int code, int rank, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* A transport's call after it was aborted (an earlier error, or Ctrl-C):
 * fills err and returns its code. */
int rr_aborted_error(rr_error *err);

#endif
