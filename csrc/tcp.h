/* TCP transport: one socket to next, one from prev, and a control star
 * through rank 0 that spreads failure notices. The sockets are connected and
 * authenticated by the caller (ringreduce/world.py); this file only moves
 * bytes on them. */
#ifndef RINGREDUCE_TCP_H
#define RINGREDUCE_TCP_H

#include "transport.h"

/* ctrl_fds: on rank 0, `size` descriptors indexed by rank (entry 0 unused,
 * -1); on other ranks, one descriptor, the connection to rank 0.
 * spin_rounds: how often to yield the core before sleeping in poll.
 * Takes ownership of every descriptor. Returns NULL on out-of-memory. */
rr_transport *rr_tcp_create(int rank, int size, int next_fd, int prev_fd,
                            const int *ctrl_fds, int n_ctrl, double timeout_s, int spin_rounds);

#endif
