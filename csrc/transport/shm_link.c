/* Single-writer single-reader byte ring in a shared mapping (see shm_link.h).
 *
 * head counts bytes ever written, tail bytes ever read (64-bit, never wrap);
 * byte i lives at data[i % capacity]. The writer publishes data with a
 * release store of head, the reader frees room with a release store of tail.
 *
 * Sleeping without a lost wake-up (Dekker): the sleeper stores its flag,
 * then (full fence) looks at the other index once more; the waker stores
 * its index, then (full fence) reads the flag. At least one of them sees the
 * other's store, so either the sleeper does not sleep or the waker wakes it.
 */
#define _GNU_SOURCE
#include "transport/shm_link.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Each index and flag on its own cache line: the two sides write different
 * lines and never bounce one between cores. */
typedef struct {
    _Atomic uint64_t v;
    char pad[56];
} line;

typedef struct {
    char magic[8];
    char nonce[32];     /* written and checked by ringreduce/shm.py */
    char pad[24];
    line head;          /* writer */
    line reader_waits;  /* reader */
    line tail;          /* reader */
    line writer_waits;  /* writer */
    line gave_up;       /* writer: set before it closes its sockets and returns on an error */
} shm_header;

_Static_assert(sizeof(shm_header) <= RR_SHM_DATA_OFFSET, "header must fit before the data");

struct rr_shm_link {
    shm_header *hdr;
    unsigned char *data;
    size_t capacity;
    size_t mapped;
    size_t gap;         /* alignment bytes this side still has to leave (writer) or skip (reader) */
};

rr_shm_link *rr_shm_link_map(int fd, rr_error *err)
{
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rr_set_error(err, RR_E_SYSTEM, -1, "shared-memory link: fstat failed: %s", strerror(errno));
        close(fd);
        return NULL;
    }
    if (st.st_size <= RR_SHM_DATA_OFFSET) {
        rr_set_error(err, RR_E_INVALID, -1, "shared-memory link: file of %lld bytes is too small",
                     (long long)st.st_size);
        close(fd);
        return NULL;
    }
    size_t size = (size_t)st.st_size;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd); /* the mapping keeps the file alive */
    if (p == MAP_FAILED) {
        rr_set_error(err, RR_E_SYSTEM, -1, "shared-memory link: mmap failed: %s", strerror(errno));
        return NULL;
    }
    rr_shm_link *link = calloc(1, sizeof *link);
    if (!link || memcmp(p, RR_SHM_MAGIC, 8) != 0) {
        if (link) rr_set_error(err, RR_E_PROTOCOL, -1, "shared-memory link: not a ringreduce link file");
        else rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        munmap(p, size);
        free(link);
        return NULL;
    }
    link->hdr = p;
    link->data = (unsigned char *)p + RR_SHM_DATA_OFFSET;
    link->capacity = size - RR_SHM_DATA_OFFSET;
    link->mapped = size;
    return link;
}

void rr_shm_link_unmap(rr_shm_link *link)
{
    if (!link) return;
    munmap(link->hdr, link->mapped);
    free(link);
}

/* Leaves (writer) or skips (reader) what it can of an alignment gap.
 * Returns the index after it. */
static uint64_t pass_gap(rr_shm_link *link, _Atomic uint64_t *mine, uint64_t at, size_t movable)
{
    size_t n = link->gap < movable ? link->gap : movable;
    if (n == 0) return at;
    link->gap -= n;
    atomic_store_explicit(mine, at + n, memory_order_release);
    return at + n;
}

/* The writable run at head: its length, and where it starts in *at. */
static size_t writable(rr_shm_link *link, uint64_t *head_out)
{
    uint64_t head = atomic_load_explicit(&link->hdr->head.v, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&link->hdr->tail.v, memory_order_acquire);
    size_t used = (size_t)(head - tail);
    size_t room = used < link->capacity ? link->capacity - used : 0;
    uint64_t h = pass_gap(link, &link->hdr->head.v, head, room);
    room -= (size_t)(h - head);
    *head_out = h;
    return room;
}

/* The readable bytes at tail, after any alignment gap. */
static size_t readable(rr_shm_link *link, uint64_t *tail_out)
{
    uint64_t tail = atomic_load_explicit(&link->hdr->tail.v, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&link->hdr->head.v, memory_order_acquire);
    size_t avail = (size_t)(head - tail);
    if (avail > link->capacity) avail = link->capacity; /* a confused writer cannot make us read past the map */
    uint64_t t = pass_gap(link, &link->hdr->tail.v, tail, avail);
    *tail_out = t;
    return avail - (size_t)(t - tail);
}

size_t rr_shm_link_write(rr_shm_link *link, const void *buf, size_t len)
{
    uint64_t head;
    size_t room = writable(link, &head);
    size_t n = len < room ? len : room;
    if (n == 0) return 0;
    size_t at = (size_t)(head % link->capacity), first = link->capacity - at;
    if (first > n) first = n;
    memcpy(link->data + at, buf, first);
    memcpy(link->data, (const unsigned char *)buf + first, n - first);
    atomic_store_explicit(&link->hdr->head.v, head + n, memory_order_release);
    return n;
}

size_t rr_shm_link_read(rr_shm_link *link, void *buf, size_t len)
{
    uint64_t tail;
    size_t avail = readable(link, &tail);
    size_t n = len < avail ? len : avail;
    if (n == 0) return 0;
    size_t at = (size_t)(tail % link->capacity), first = link->capacity - at;
    if (first > n) first = n;
    memcpy(buf, link->data + at, first);
    memcpy((unsigned char *)buf + first, link->data, n - first);
    atomic_store_explicit(&link->hdr->tail.v, tail + n, memory_order_release);
    return n;
}

size_t rr_shm_link_read_window(rr_shm_link *link, const void **p)
{
    uint64_t tail;
    size_t avail = readable(link, &tail);
    size_t at = (size_t)(tail % link->capacity), first = link->capacity - at;
    *p = link->data + at;
    return avail < first ? avail : first;
}

void rr_shm_link_consume(rr_shm_link *link, size_t n)
{
    uint64_t tail = atomic_load_explicit(&link->hdr->tail.v, memory_order_relaxed);
    atomic_store_explicit(&link->hdr->tail.v, tail + n, memory_order_release);
}

size_t rr_shm_link_write_window(rr_shm_link *link, void **p)
{
    uint64_t head;
    size_t room = writable(link, &head);
    size_t at = (size_t)(head % link->capacity), first = link->capacity - at;
    *p = link->data + at;
    return room < first ? room : first;
}

void rr_shm_link_commit(rr_shm_link *link, size_t n)
{
    uint64_t head = atomic_load_explicit(&link->hdr->head.v, memory_order_relaxed);
    atomic_store_explicit(&link->hdr->head.v, head + n, memory_order_release);
}

void rr_shm_link_align_tx(rr_shm_link *link)
{
    uint64_t head = atomic_load_explicit(&link->hdr->head.v, memory_order_relaxed) + link->gap;
    link->gap += (size_t)((RR_SHM_ALIGN - head % RR_SHM_ALIGN) % RR_SHM_ALIGN);
}

void rr_shm_link_align_rx(rr_shm_link *link)
{
    uint64_t tail = atomic_load_explicit(&link->hdr->tail.v, memory_order_relaxed) + link->gap;
    link->gap += (size_t)((RR_SHM_ALIGN - tail % RR_SHM_ALIGN) % RR_SHM_ALIGN);
}

size_t rr_shm_link_capacity(const rr_shm_link *link) { return link->capacity; }

size_t rr_shm_link_pending(rr_shm_link *link)
{
    uint64_t head = atomic_load_explicit(&link->hdr->head.v, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&link->hdr->tail.v, memory_order_acquire);
    return (size_t)(head - tail);
}

int rr_shm_link_reader_waits(rr_shm_link *link)
{
    atomic_thread_fence(memory_order_seq_cst);
    return atomic_load_explicit(&link->hdr->reader_waits.v, memory_order_relaxed) != 0;
}

int rr_shm_link_writer_waits(rr_shm_link *link)
{
    atomic_thread_fence(memory_order_seq_cst);
    return atomic_load_explicit(&link->hdr->writer_waits.v, memory_order_relaxed) != 0;
}

int rr_shm_link_writer_sleeps(rr_shm_link *link) { return rr_shm_link_writer_sleeps_until(link, link->capacity - 1); }

int rr_shm_link_writer_sleeps_until(rr_shm_link *link, size_t most)
{
    atomic_store_explicit(&link->hdr->writer_waits.v, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    if (rr_shm_link_pending(link) <= most) {
        rr_shm_link_writer_done(link);
        return 1;
    }
    return 0;
}

int rr_shm_link_reader_sleeps(rr_shm_link *link)
{
    atomic_store_explicit(&link->hdr->reader_waits.v, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    if (rr_shm_link_pending(link) > 0) {
        rr_shm_link_reader_done(link);
        return 1;
    }
    return 0;
}

void rr_shm_link_writer_done(rr_shm_link *link)
{
    atomic_store_explicit(&link->hdr->writer_waits.v, 0, memory_order_relaxed);
}

void rr_shm_link_reader_done(rr_shm_link *link)
{
    atomic_store_explicit(&link->hdr->reader_waits.v, 0, memory_order_relaxed);
}

/* A seq_cst store, made before the writer's process closes its sockets and
 * hands its buffers back to its caller: a reader that loads it after reading
 * those buffers (process_vm_readv, csrc/schedule/cma.c) sees it set whenever the
 * buffers may have been rewritten, which a socket's close, delivered by the
 * kernel in its own time, does not promise. */
void rr_shm_link_mark_gave_up(rr_shm_link *link)
{
    if (link) atomic_store(&link->hdr->gave_up.v, 1);
}

int rr_shm_link_gave_up(rr_shm_link *link)
{
    atomic_thread_fence(memory_order_seq_cst); /* after the reads it vouches for */
    return link && atomic_load(&link->hdr->gave_up.v) != 0;
}
