/* A one-way byte pipe between two ranks on the same host, through shared
 * memory: one writer, one reader, no locks, no system calls on the way.
 *
 * Why: on one host, loopback TCP copies every byte into the kernel and out
 * again and caps the whole ring at one stream's bandwidth. Through a shared
 * mapping the writer copies in and the reader copies out, both in user space.
 *
 * The pipe only moves bytes. Sleeping and waking stay with the TCP transport
 * (csrc/transport/tcp.c): a side that finds the pipe full (writer) or empty (reader)
 * raises its flag in the mapping (`writer_waits` / `reader_waits`, through
 * rr_shm_link_*_sleeps below) and sleeps in poll on the link's TCP socket; the
 * other side, having moved the indexes, sees the flag and sends one byte on
 * that socket. The socket also still says when the peer dies (EOF).
 *
 * The file behind the mapping is made and checked by ringreduce/shm.py; its
 * layout is fixed here (RR_SHM_DATA_OFFSET, the magic) and there. */
#ifndef RINGREDUCE_SHM_LINK_H
#define RINGREDUCE_SHM_LINK_H

#include <stddef.h>

#include "common/error.h"

#define RR_SHM_MAGIC "RRSHM1\0\0"
#define RR_SHM_DATA_OFFSET 4096

typedef struct rr_shm_link rr_shm_link;

/* Maps the file (taking ownership of fd). NULL with err filled on failure. */
rr_shm_link *rr_shm_link_map(int fd, rr_error *err);
void rr_shm_link_unmap(rr_shm_link *link);

/* Moves up to len bytes; returns how many (0 when full / empty). */
size_t rr_shm_link_write(rr_shm_link *link, const void *buf, size_t len);
size_t rr_shm_link_read(rr_shm_link *link, void *buf, size_t len);

/* After a write (read) that moved bytes: whether the reader (writer) is
 * asleep and needs a wake-up byte on the socket. */
int rr_shm_link_reader_waits(rr_shm_link *link);
int rr_shm_link_writer_waits(rr_shm_link *link);

/* Before sleeping: raise this side's flag, then look once more. Returns 1
 * when there is room (data) after all: the flag is lowered again and the
 * caller must not sleep. After the sleep, lower the flag with *_done. */
int rr_shm_link_writer_sleeps(rr_shm_link *link);
/* The same for a writer waiting until at most `most` bytes are unread (the
 * reader kicks after every consume while the flag is up). */
int rr_shm_link_writer_sleeps_until(rr_shm_link *link, size_t most);
int rr_shm_link_reader_sleeps(rr_shm_link *link);
void rr_shm_link_writer_done(rr_shm_link *link);
void rr_shm_link_reader_done(rr_shm_link *link);

/* Bytes the reader has not taken yet. */
size_t rr_shm_link_pending(rr_shm_link *link);
size_t rr_shm_link_capacity(const rr_shm_link *link);

/* Zero copy: the ring reduces straight out of (into) the mapping instead of
 * copying through a buffer of its own. A window is the contiguous run of
 * bytes readable (writable) now, the part before the end of the buffer
 * first (0 when empty / full); consume (commit) then hands n <= that many
 * back to the other side. The wake-up rule is as after a read (write). */
size_t rr_shm_link_read_window(rr_shm_link *link, const void **p);
void rr_shm_link_consume(rr_shm_link *link, size_t n);
size_t rr_shm_link_write_window(rr_shm_link *link, void **p);
void rr_shm_link_commit(rr_shm_link *link, size_t n);

/* Moves this side's stream position on to the next multiple of
 * RR_SHM_ALIGN: the writer (align_tx) leaves a gap, the reader (align_rx)
 * skips it; both take effect with the next write / read / window. The two
 * ends call it at the same point of their streams (the start of a ring
 * operation, where all earlier bytes have been read), so they agree on the
 * gap without a word, and every element of the operation lies aligned in
 * the mapping, never split by the end of the buffer. */
#define RR_SHM_ALIGN 64
void rr_shm_link_align_tx(rr_shm_link *link);
void rr_shm_link_align_rx(rr_shm_link *link);

/* The writer's side gave up (an error, Ctrl-C): set before it closes its
 * sockets and returns, so a reader of its buffers (csrc/schedule/cma.c) can tell the
 * bytes it just read may not be the operation's. */
void rr_shm_link_mark_gave_up(rr_shm_link *link);
int rr_shm_link_gave_up(rr_shm_link *link);

#endif
