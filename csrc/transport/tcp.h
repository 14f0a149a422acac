/* TCP transport: one socket to next, one from prev, and a control star
 * through rank 0 that spreads failure notices. The sockets are connected and
 * authenticated by the caller (ringreduce/world.py); this file only moves
 * bytes on them. */
#ifndef RINGREDUCE_TCP_H
#define RINGREDUCE_TCP_H

#include "transport/transport.h"

/* ctrl_fds: on rank 0, `size` descriptors indexed by rank (entry 0 unused,
 * -1); on other ranks, one descriptor, the connection to rank 0.
 * spin_rounds: how often to yield the core before sleeping in poll.
 * tx_shm_fd, rx_shm_fd: files of shared-memory links to next and from prev
 * (ringreduce/shm.py), or -1: that link's data goes through its socket.
 * Takes ownership of every descriptor. Returns NULL with err filled when
 * memory or a mapping fails. */
rr_transport *rr_tcp_create(int rank, int size, int next_fd, int prev_fd,
                            const int *ctrl_fds, int n_ctrl, double timeout_s, int spin_rounds,
                            int tx_shm_fd, int rx_shm_fd, rr_error *err);

#endif
