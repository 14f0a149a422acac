/* The control star: every rank's connection to rank 0, kept from the
 * rendezvous, over which failure notices spread (see csrc/transport/tcp.c for who
 * sends what). A background thread serves it at all times, so a notice is
 * relayed by rank 0 and recorded by every rank even while that rank is
 * outside any collective (computing, sleeping in Python). The data path only
 * asks it questions and tells it findings; nothing here touches Python.
 */
#ifndef RINGREDUCE_CONTROL_STAR_H
#define RINGREDUCE_CONTROL_STAR_H

#include "common/error.h"

typedef struct rr_star rr_star;

/* fds: on rank 0, `size` descriptors indexed by rank (entry 0 unused, -1);
 * elsewhere one, the connection to rank 0. Takes ownership of them (also on
 * failure). Returns NULL with err filled when memory or the thread fails. */
rr_star *rr_star_start(int rank, int size, const int *fds, int n, rr_error *err);

/* Stops the thread and closes the descriptors; say_bye first tells the
 * others this rank leaves in good order. */
void rr_star_stop(rr_star *s, int say_bye);

/* Readable (for poll) from the moment a verdict is known, for good. */
int rr_star_wake_fd(const rr_star *s);

/* The verdict: the rank at fault, or -1 while there is none; *silent says
 * whether it was judged silent (else it was lost: died, closed, failed). */
int rr_star_verdict(rr_star *s, int *silent);

/* Whether `rank` said goodbye (rank 0 relays every goodbye to all). */
int rr_star_departed(rr_star *s, int rank);

/* Waits up to wait_ms for a verdict, or for `watch` (if >= 0) to have said
 * goodbye. Returns rr_star_verdict's answer. */
int rr_star_wait(rr_star *s, int wait_ms, int watch, int *silent);

/* This rank found `rank` lost: records it unless a verdict came first, and
 * tells everyone through rank 0. Returns the verdict that stands. */
int rr_star_report_lost(rr_star *s, int rank, int *silent);

/* This rank waited the whole timeout on `waits_on`: tells the judge, rank 0,
 * which names the silent rank (rr_star_wait then returns it). */
void rr_star_suspect(rr_star *s, int waits_on);

#endif
