/* The ring schedule.
 *
 *            +--> rank 1 --+          Every rank sends only to next
 *            |             v          (rank + 1) and receives only from
 *         rank 0        rank 2        prev (rank - 1), both at once.
 *            ^             |
 *            +-- rank 3 <--+
 *
 * The buffer is cut into N chunks (rr_chunk_count: the first count % N
 * chunks get one extra element; with count < N some are empty). One
 * allreduce is 2(N-1) steps g = 0 .. 2N-3 of a single formula:
 *
 *     at step g, rank r sends chunk (r - g - 1) mod N
 *                   and receives chunk (r - g - 2) mod N
 *
 *   ScatterReduce, g = 0 .. N-2: the received chunk is reduced into ours.
 *     After its last step (g = N-2) rank r has received chunk r for the
 *     N-1st time: chunk r now holds the reduction over all ranks.
 *   AllGather, g = N-1 .. 2N-3: the received chunk is copied into place.
 *     At g = N-1 rank r sends its finished chunk r, and every later step
 *     forwards what arrived in the step before.
 *
 * What rank r receives at step g is exactly what it sends at step g+1. So
 * the two phases are one stream: each chunk moves in segments, and segment
 * j of step g+1 leaves as soon as segment j of step g has arrived and been
 * reduced, while the sockets carry the next one. Sending, receiving and
 * reducing overlap, also across step and phase boundaries.
 *
 * Each chunk is reduced in one fixed order (the order the ring visits the
 * ranks) and then only copied, never re-reduced: every rank ends with the
 * same bits. Each rank sends and receives 2(N-1)/N of the buffer.
 *
 * Extra memory: one staging segment, whatever the tensor's size.
 *
 * Buffers in a device's memory take the same schedule on a pinned host
 * mirror ("the staged path", below ring_steps).
 */
#include "schedule/ring.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "schedule/cma.h"
#include "device/device.h"
#include "schedule/recursive_doubling.h"
#include "schedule/host_arena.h"
#include "kernels/reduce.h"

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define MAX_BLOB ((size_t)64 << 20)

static int mod(int a, int n) { return ((a % n) + n) % n; }

static uint64_t next_ring_id;

rr_ring *rr_ring_create(rr_transport *t, size_t segment_bytes)
{
    rr_ring *ring = calloc(1, sizeof *ring);
    if (!ring) return NULL;
    ring->id = __atomic_add_fetch(&next_ring_id, 1, __ATOMIC_RELAXED);
    segment_bytes = (segment_bytes + 63) / 64 * 64;
    if (segment_bytes < 64) segment_bytes = 64;
    ring->staging = malloc(segment_bytes);
    if (!ring->staging) { free(ring); return NULL; }
    ring->transport = t;
    ring->rank = t ? t->rank : 0;
    ring->size = t ? t->size : 1;
    ring->segment = segment_bytes;
    ring->zero_copy = 0; /* until the ranks agree on it (ring.h) */
    return ring;
}

int rr_ring_set_segment(rr_ring *ring, size_t segment_bytes)
{
    segment_bytes = (segment_bytes + 63) / 64 * 64;
    if (segment_bytes < 64) segment_bytes = 64;
    void *staging = malloc(segment_bytes);
    if (!staging) return -1;
    free(ring->staging);
    ring->staging = staging;
    ring->segment = segment_bytes;
    return 0;
}

int rr_ring_attach_arena(rr_ring *ring, rr_arena *arena)
{
    if (!ring->transport || !ring->transport->ops->stalled) return -1; /* its waits could not be judged */
    rr_arena_unmap(ring->arena);
    ring->arena = arena;
    ring->use_arena = 1;
    return 0;
}

void rr_ring_destroy(rr_ring *ring)
{
    if (!ring) return;
    if (ring->transport) ring->transport->ops->destroy(ring->transport);
    rr_arena_unmap(ring->arena);
    rr_peer_maps_clear(&ring->peer_maps);
    free(ring->staging);
    free(ring);
}

size_t rr_chunk_count(size_t count, int size, int i)
{
    return count / (size_t)size + ((size_t)i < count % (size_t)size ? 1 : 0);
}

static int fail(rr_ring *ring, int code, rr_error *err)
{
    ring->transport->ops->abort(ring->transport, err);
    return code;
}

int rr_ring_begin(rr_ring *ring, rr_error *err)
{
    if (!ring->transport) return RR_OK; /* a world of one */
    const rr_transport_ops *ops = ring->transport->ops;
    int rc = ops->begin ? ops->begin(ring->transport, err) : RR_OK;
    return rc == RR_OK ? RR_OK : fail(ring, rc, err);
}

/* What a received run of n bytes at byte `at` of the buffer becomes at
 * step g: reduced with our own input (steps below reduce_until) or copied
 * (later steps) into buf and, when `out` is given, also into the send
 * window as the next step's bytes. A partial that is not final goes to
 * `out` alone when given: nobody reads it from buf. The kernels and their
 * order are those of the copying path, so the bits are too. */
static void absorb(int N, const char *src, char *buf, size_t at, const char *in, size_t n, char *out, int g,
                   int reduce_until, rr_dtype dtype, rr_op op)
{
    const size_t count = n / rr_dtype_size(dtype);
    char *dst = buf + at;
    if (g >= reduce_until) {
        memcpy(dst, in, n);
        if (out) memcpy(out, dst, n); /* dst is still in cache */
        return;
    }
    const int final = g == reduce_until - 1, mean = op == RR_AVG && rr_avg_is_mean(dtype);
    char *to = out && !final ? out : dst;
    /* The received partial holds g + 1 contributions; ours makes g + 2. */
    if (mean) rr_mean_fold(to, src + at, in, count, dtype, g + 2);
    else rr_reduce3(to, src + at, in, count, dtype, op);
    if (op == RR_AVG && !mean && final) rr_divide(to, count, dtype, N);
    if (out && final) memcpy(out, dst, n);
}

static size_t longest_chunk(const size_t *len, int N)
{
    size_t longest = 0;
    for (int c = 0; c < N; c++) if (len[c] > longest) longest = len[c];
    return longest;
}

/* The slice is how far a rank runs ahead of its neighbours: piece (s, g+1)
 * follows piece (s, g) in the stream by one piece, so a rank may send up to
 * a slice beyond what it has received. Running K slices of 256 KiB ahead
 * (slices interleaved K at a time, step by step) is byte for byte the stream
 * of slices of K * 256 KiB, so the slice size is the run-ahead. Half the
 * default 1 MiB mapping (K = 2): a rank descheduled on a loaded machine
 * leaves its neighbours up to a slice to take and a slice of room to fill
 * (docs/performance.md, "Running ahead"). Fixed, not the segment nor the
 * mapping: the byte order depends on it and every rank must agree. */
#define ZC_SLICE ((size_t)512 << 10)

/* Below this chunk size the copying path's first step fits in a default
 * (1 MiB) mapping, it waits less than the slice-by-slice schedule, and wins
 * (docs/performance.md, "Shared memory without the extra copy"). Every rank
 * sees the same chunk sizes, so every rank decides alike. */
#define ZC_MIN_CHUNK ((size_t)2 << 20)

static int zero_copy_pays(const size_t *len, int N) { return longest_chunk(len, N) >= ZC_MIN_CHUNK; }

/* A cursor into the slice-major stream of ring_steps_zero_copy: slice s,
 * step g, bytes `at` of that step's piece. */
typedef struct { size_t s; int g; size_t at; } zc_cursor;

/* Bytes of chunk c's piece in slice s (slices of `slice` bytes). */
static size_t piece(const size_t *len, int c, size_t s, size_t slice)
{
    size_t from = s * slice;
    return len[c] <= from ? 0 : len[c] - from < slice ? len[c] - from : slice;
}

/* Moves a cursor over finished (and empty) pieces. At step g its stream
 * carries chunk (first_chunk - g) mod N: first_chunk is r - 1 for sends,
 * r - 2 for receives. */
static void zc_advance(zc_cursor *c, int first_chunk, int N, const size_t *len, size_t slices, size_t slice,
                       int g0, int g1)
{
    while (c->s < slices && c->at == piece(len, mod(first_chunk - c->g, N), c->s, slice)) {
        c->at = 0;
        if (++c->g == g1) { c->g = g0; c->s++; }
    }
}

/* ring_steps on a host buffer over a transport with zero-copy windows
 * (both links shared memory), as NCCL does it. Per byte of a step the
 * copying path reads 4 streams and writes 3 (buf -> mapping, mapping ->
 * staging, staging + src -> buf). Here a received byte is reduced straight
 * out of the mapping and the result goes straight into the next link's
 * mapping when it is sent on next: read 2, write 1 (2 in AllGather and at
 * the last reducing step, whose result buf keeps).
 *
 * For that the bytes travel slice-major: every chunk is cut into slices of
 * ZC_SLICE bytes and slice s runs all steps g0 .. g1-1 before slice s + 1
 * starts. A rank then only sends ahead of what it receives by one piece
 * (ZC_SLICE bytes), which fits in a default mapping; in the
 * step-major order of the copying path it sends a whole chunk from src
 * first and must keep everything received meanwhile in buf. The order
 * differs from the copying path's, so every rank of the ring must take this
 * path or none (ringreduce/shm.py agrees on it).
 *
 * When the next rank is slow to take bytes (its mapping full), received
 * bytes are reduced into buf and sent from there later, as the copying path
 * does: a rank never waits on its send window while bytes it could take are
 * waiting, or a ring of full mappings would wait on itself. That holds for
 * any slice and mapping size: a mapping smaller than a slice only makes the
 * first step's piece go out in parts, with received bytes parked in buf. */
static int ring_steps_zero_copy(rr_ring *ring, const char *src, char *buf, const size_t *off, const size_t *len,
                                int g0, int g1, int reduce_until, rr_dtype dtype, rr_op op, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    const size_t slice = ZC_SLICE, esize = rr_dtype_size(dtype);
    rr_transport *t = ring->transport;
    const rr_transport_ops *ops = t->ops;
    const size_t slices = (longest_chunk(len, N) + slice - 1) / slice;
    zc_cursor snd = {0, g0, 0}, rcv = {0, g0, 0};
    int reduced = 0, need_rc;
    for (;;) {
        zc_advance(&snd, r - 1, N, len, slices, slice, g0, g1);
        zc_advance(&rcv, r - 2, N, len, slices, slice, g0, g1);
        if (!reduced && (rcv.s == slices || (rcv.s + 1 == slices && rcv.g >= reduce_until))) {
            reduced = 1;
            ring->phase_times[1] = monotonic_s(); /* owned chunk final: its last slice is */
        }
        if (snd.s == slices && rcv.s == slices) break;
        const int sc = mod(r - snd.g - 1, N), rc = mod(r - rcv.g - 2, N);
        /* The piece being sent is the one being received, forwarded. */
        const int forwarding = snd.s == rcv.s && snd.g == rcv.g + 1;
        const int fused = forwarding && snd.at == rcv.at;
        int moved = 0, want_tx = 0;

        /* Not fused: send what is ready, from src (first step) or buf. */
        if (snd.s < slices && !fused) {
            if (ring->stage && snd.g == g0 && (need_rc = rr_stage_need(ring->stage, sc, err)) != RR_OK)
                return fail(ring, need_rc, err);
            /* A forwarded piece is ready as far as it has been received:
             * the receiver may still be on an earlier slice. */
            const int received = rcv.s > snd.s || (rcv.s == snd.s && rcv.g >= snd.g);
            const size_t ready = snd.g == g0 || received ? piece(len, sc, snd.s, slice) : forwarding ? rcv.at : 0;
            const char *from = (snd.g == g0 ? src : buf) + off[sc] + snd.s * slice;
            while (snd.at < ready) {
                void *w;
                size_t m = ops->tx_window(t, &w);
                if (m > ready - snd.at) m = ready - snd.at;
                m -= m % esize; /* whole elements, so the reader's windows hold whole ones */
                if (m == 0) { want_tx = 1; break; }
                memcpy(w, from + snd.at, m);
                rr_transport_commit(t, RR_SENT_RING, m);
                snd.at += m;
                moved = 1;
            }
        }

        if (rcv.s < slices) {
            if (ring->stage && (need_rc = rr_stage_need(ring->stage, rc, err)) != RR_OK)
                return fail(ring, need_rc, err);
            const void *in;
            size_t n = ops->rx_window(t, &in), rest = piece(len, rc, rcv.s, slice) - rcv.at;
            if (n > rest) n = rest;
            n -= n % esize;
            const size_t at = off[rc] + rcv.s * slice + rcv.at;
            void *w = NULL;
            size_t m = 0;
            if (n && fused) {
                m = ops->tx_window(t, &w);
                m -= m % esize;
            }
            if (n && m) {
                if (n > m) n = m;
                absorb(N, src, buf, at, in, n, w, rcv.g, reduce_until, dtype, op);
                ops->rx_consume(t, n);
                rr_count_received(t, t->tx_via, n);
                rr_transport_commit(t, RR_SENT_RING, n);
                snd.at += n;
                rcv.at += n;
                moved = 1;
            } else if (n && (!moved || snd.g == g0)) {
                /* Sends that just moved come first, so the ring gets back to
                 * fused; but receiving never waits on a piece from src. */
                absorb(N, src, buf, at, in, n, NULL, rcv.g, reduce_until, dtype, op);
                ops->rx_consume(t, n);
                rr_count_received(t, t->tx_via, n);
                rcv.at += n;
                moved = 1;
            }
        }
        if (!moved) {
            int rc_ = ops->wait(t, want_tx, rcv.s < slices, err);
            if (rc_ != RR_OK) return fail(ring, rc_, err);
        }
    }
    return RR_OK;
}

/* Runs steps g0 .. g1-1 of the schedule above over chunks at byte offsets
 * off[] with byte lengths len[]. Steps below `reduce_until` reduce, later
 * steps copy; for avg, each segment of the owned chunk is divided the moment
 * it is final (16-bit floats: every fold is a running mean, nothing to
 * divide). The input is read from src (which may be buf): the first step
 * sends from it and each reduction reads its own chunk from it, so every
 * byte of buf is written exactly once and out of place costs no copy.
 *
 * During a staged operation (ring->stage, the staged path below) src and
 * buf are a device's pinned mirror: before a chunk is first read or written
 * its trip down must be done (rr_stage_need), and the moment a chunk is
 * final it goes back up (rr_stage_final), while the ring goes on. */
static int ring_steps(rr_ring *ring, const char *src, char *buf, const size_t *off, const size_t *len, int g0,
                      int g1, int reduce_until, rr_dtype dtype, rr_op op, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    const size_t seg = ring->segment, esize = rr_dtype_size(dtype);
    const int mean = op == RR_AVG && rr_avg_is_mean(dtype); /* a running mean: no division at the end */
    rr_transport *t = ring->transport;
    rr_stage *stage = ring->stage;
    char *staging = ring->staging; /* where reducing receives land */
    int sg = g0, rg = g0;          /* the steps being sent and received */
    size_t soff = 0;               /* bytes of step sg's chunk sent */
    size_t roff = 0, rdone = 0;    /* bytes of step rg's chunk received; of those, ready to forward */
    int rc_ = RR_OK;
    if (t->ops->align) t->ops->align(t);
    if (rr_cma_wanted(ring, len) && ++ring->cma_ops)
        return rr_cma_steps(ring, src, buf, off, len, g0, g1, reduce_until, dtype, op, err);
    if (ring->zero_copy && t->ops->rx_window && zero_copy_pays(len, N) && ++ring->zero_copy_ops)
        return ring_steps_zero_copy(ring, src, buf, off, len, g0, g1, reduce_until, dtype, op, err);
#define STAGE(CALL) do { if (stage && (rc_ = (CALL)) != RR_OK) return fail(ring, rc_, err); } while (0)
    STAGE(rr_stage_need(stage, mod(r - g0 - 1, N), err)); /* the chunk the first step sends */

    for (;;) {
        while (sg < g1 && soff == len[mod(r - sg - 1, N)]) { sg++; soff = 0; }
        while (rg < g1 && rdone == len[mod(r - rg - 2, N)]) {
            if (rg >= reduce_until - 1) STAGE(rr_stage_final(stage, mod(r - rg - 2, N), err));
            rg++;
            roff = rdone = 0;
            if (rg == reduce_until) ring->phase_times[1] = monotonic_s(); /* owned chunk final */
        }
        if (sg >= g1 && rg >= g1) break;

        /* Send window: the rest of the current segment, but never past what
         * is ready: the chunk still being received is forwarded as it comes. */
        const char *sp = NULL;
        size_t sl = 0;
        if (sg < g1) {
            const int sc = mod(r - sg - 1, N);
            size_t limit = sg != g0 && sg - 1 == rg ? rdone : len[sc];
            size_t seg_end = (soff / seg + 1) * seg;
            if (seg_end > limit) seg_end = limit;
            sp = (sg == g0 ? src : buf) + off[sc] + soff;
            sl = seg_end > soff ? seg_end - soff : 0;
        }
        /* Receive window: the rest of the current segment, into the staging
         * segment when it must be reduced, else into place. */
        const int rc = mod(r - rg - 2, N);
        const int reducing = rg < reduce_until;
        const size_t rseg_start = roff / seg * seg;
        char *rp = NULL;
        size_t rl = 0, rseg_end = 0;
        if (rg < g1 && roff < len[rc]) {
            STAGE(rr_stage_need(stage, rc, err));
            rseg_end = rseg_start + seg < len[rc] ? rseg_start + seg : len[rc];
            rp = reducing ? staging + (roff - rseg_start) : buf + off[rc] + roff;
            rl = rseg_end - roff;
        }

        size_t sent = 0, rcvd = 0;
        rc_ = rr_transport_exchange(t, RR_SENT_RING, sp, sl, &sent, rp, rl, &rcvd, err);
        if (rc_ != RR_OK) return fail(ring, rc_, err);
        soff += sent;
        roff += rcvd;
        if (rl && roff == rseg_end) {
            const size_t n = (rseg_end - rseg_start) / esize;
            char *dst = buf + off[rc] + rseg_start;
            const char *mine = src + off[rc] + rseg_start;
            if (reducing && mean) {
                /* The received partial holds rg + 1 contributions; ours makes rg + 2. */
                rr_mean_fold(dst, mine, staging, n, dtype, rg + 2);
            } else if (reducing) {
                rr_reduce3(dst, mine, staging, n, dtype, op);
                if (op == RR_AVG && rg == N - 2) rr_divide(dst, n, dtype, N);
            }
            rdone = rseg_end;
        }
    }
#undef STAGE
    return RR_OK;
}

/* Chunk table for `count` elements: offsets and lengths in bytes. */
static int chunk_table(int N, size_t count, size_t esize, size_t **off, size_t **len)
{
    *off = malloc(sizeof(size_t) * (size_t)N);
    *len = malloc(sizeof(size_t) * (size_t)N);
    if (!*off || !*len) { free(*off); free(*len); return -1; }
    size_t at = 0;
    for (int i = 0; i < N; i++) {
        (*off)[i] = at;
        (*len)[i] = rr_chunk_count(count, N, i) * esize;
        at += (*len)[i];
    }
    return 0;
}

/* The staged path: a collective on a device's buffers is the host ring run
 * in place on the device's pinned mirror (device.h).
 *
 *   down  every chunk whose input the ring reads is copied down once, in
 *         the order the ring first needs it (the chunk the first step sends,
 *         then the one each step reduces into), a ticket after each;
 *   ring  the host ring runs on the mirror, any of its paths (copying,
 *         zero-copy, Cross Memory Attach) as on a host rank, waiting for a
 *         chunk's ticket only when it first touches that chunk;
 *   up    each chunk the operation finishes is copied up the moment the
 *         ring has made it final (after the ring, for the zero-copy path,
 *         whose chunks all become final in its last slices);
 *   wait  once, for the last trip up.
 *
 * So an allreduce costs N copies down, N up and N + 1 tickets, whatever its
 * size, while the device's copies overlap the network; the bytes on the
 * wire, the kernels and their order are the host ring's, so device and host
 * ranks share one ring, every path included, and get the same bits. */
struct rr_stage {
    rr_device *dev;
    int n;                  /* chunks */
    char *host;             /* the mirror */
    char *dst;              /* device: where final chunks go */
    const size_t *off, *len;
    uint64_t *down;         /* per chunk: its trip down's ticket; 0 once waited for, or none */
    unsigned char *up;      /* per chunk: 1 while it still has to go up */
};

int rr_stage_need(rr_stage *s, int c, rr_error *err)
{
    const uint64_t ticket = s->down[c];
    if (!ticket) return RR_OK;
    int rc = rr_dev_done(s->dev, ticket, 1, err);
    if (rc < 0) return -rc;
    /* One stream runs in order: every trip queued before this one is done too. */
    for (int i = 0; i < s->n; i++) if (s->down[i] <= ticket) s->down[i] = 0;
    return RR_OK;
}

int rr_stage_final(rr_stage *s, int c, rr_error *err)
{
    if (!s->up[c]) return RR_OK;
    s->up[c] = 0;
    return rr_dev_to_device(s->dev, s->dst + s->off[c], s->host + s->off[c], s->len[c], err);
}

enum { UP_ALL, UP_OWN, UP_OTHERS }; /* the chunks an operation finishes */

/* Queues the trips down (all chunks, or only this rank's when own_down) of
 * src into the mirror and installs the stage on the ring. On failure the
 * ring is failed (the other ranks learn it) and nothing is left installed. */
static int stage_begin(rr_ring *ring, rr_stage *s, rr_device *dev, const char *src, char *dst, size_t bytes,
                       const size_t *off, const size_t *len, int own_down, int up, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    *s = (rr_stage){.dev = dev, .n = N, .dst = dst, .off = off, .len = len};
    int rc = dev->ops->begin(dev, err);
    if (rc == RR_OK) rc = rr_device_reserve(dev, bytes, err);
    if (rc == RR_OK) {
        s->host = dev->mirror;
        s->down = calloc((size_t)N, sizeof *s->down);
        s->up = calloc((size_t)N, 1);
        if (!s->down || !s->up) {
            rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
            rc = err->code;
        }
    }
    /* In the order the ring first needs them: step g sends chunk r - g - 1
     * and reduces chunk r - g - 2 into ours, so r - 1, r - 2, ..., r. */
    for (int k = 1; rc == RR_OK && k <= N; k++) {
        const int c = mod(r - k, N);
        if (!len[c] || (own_down && c != r)) continue;
        rc = rr_dev_to_host(dev, s->host + off[c], src + off[c], len[c], err);
        if (rc == RR_OK && !(s->down[c] = rr_dev_mark(dev, err))) rc = err->code;
    }
    if (rc != RR_OK) {
        rr_error ignored;
        if (s->down) rr_device_sync(dev, &ignored); /* nothing left in flight on the mirror */
        free(s->down);
        free(s->up);
        return fail(ring, rc, err);
    }
    for (int c = 0; c < N; c++) s->up[c] = len[c] && (up == UP_ALL || (up == UP_OWN) == (c == r));
    ring->stage = s;
    return RR_OK;
}

/* After the host ring returned rc: what is still to go up goes, then the
 * one wait. A ring that failed has failed already; the device is drained
 * either way, so the mirror is free for the next operation. */
static int stage_end(rr_ring *ring, rr_stage *s, int rc, rr_error *err)
{
    ring->stage = NULL;
    if (rc == RR_OK) {
        for (int c = 0; c < s->n && rc == RR_OK; c++) rc = rr_stage_final(s, c, err);
        if (rc == RR_OK) rc = rr_device_sync(s->dev, err);
        if (rc != RR_OK) fail(ring, rc, err);
    } else {
        rr_error ignored;
        rr_device_sync(s->dev, &ignored);
    }
    free(s->down);
    free(s->up);
    return rc;
}

static int reduce_phases(rr_ring *ring, rr_device *dev, const void *src, void *buf, size_t count,
                         rr_dtype dtype, rr_op op, int g1, rr_error *err)
{
    const int N = ring->size;
    const size_t bytes = count * rr_dtype_size(dtype);
    if (rr_dtype_size(dtype) == 0 || op < 0 || op >= RR_NUM_OPS) {
        rr_set_error(err, RR_E_INVALID, -1, "unsupported dtype %d or op %d", (int)dtype, (int)op);
        return err->code;
    }
    if (N == 1) { /* avg over one rank divides by 1 */
        if (src == buf || bytes == 0) return RR_OK;
        if (!dev) { memmove(buf, src, bytes); return RR_OK; }
        int rc = dev->ops->begin(dev, err);
        if (rc == RR_OK) rc = rr_dev_copy(dev, buf, src, bytes, err);
        return rc == RR_OK ? rr_device_sync(dev, err) : rc;
    }
    size_t *off, *len;
    if (chunk_table(N, count, rr_dtype_size(dtype), &off, &len)) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    int rc;
    if (!dev) {
        rc = ring_steps(ring, src, buf, off, len, 0, g1, N - 1, dtype, op, err);
    } else {
        rr_stage s;
        rc = stage_begin(ring, &s, dev, src, buf, bytes, off, len, 0, g1 == 2 * N - 2 ? UP_ALL : UP_OWN, err);
        if (rc == RR_OK)
            rc = stage_end(ring, &s, ring_steps(ring, s.host, s.host, off, len, 0, g1, N - 1, dtype, op, err), err);
    }
    free(off);
    free(len);
    return rc;
}

int rr_allreduce(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                 rr_op op, rr_error *err)
{
    ring->phase_times[0] = ring->phase_times[1] = monotonic_s();
    int rc = reduce_phases(ring, dev, src, dst, count, dtype, op, 2 * ring->size - 2, err);
    ring->phase_times[2] = monotonic_s();
    return rc;
}

int rr_reduce_scatter(rr_ring *ring, rr_device *dev, const void *src, void *dst, size_t count, rr_dtype dtype,
                      rr_op op, rr_error *err)
{
    return reduce_phases(ring, dev, src, dst, count, dtype, op, ring->size - 1, err);
}

int rr_allgather(rr_ring *ring, rr_device *dev, void *buf, const size_t *nbytes, rr_error *err)
{
    const int N = ring->size;
    if (N == 1) return RR_OK;
    size_t *off = malloc(sizeof(size_t) * (size_t)N), at = 0;
    if (!off) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    for (int i = 0; i < N; i++) { off[i] = at; at += nbytes[i]; }
    /* The AllGather steps of the schedule; uint8 so no reduction applies.
     * Staged, only this rank's block goes down and every other one up. */
    int rc;
    if (!dev) {
        rc = ring_steps(ring, buf, buf, off, nbytes, N - 1, 2 * N - 2, 0, RR_UINT8, RR_SUM, err);
    } else {
        rr_stage s;
        rc = stage_begin(ring, &s, dev, buf, buf, at, off, nbytes, 1, UP_OTHERS, err);
        if (rc == RR_OK)
            rc = stage_end(ring, &s, ring_steps(ring, s.host, s.host, off, nbytes, N - 1, 2 * N - 2, 0, RR_UINT8,
                                                RR_SUM, err), err);
    }
    free(off);
    return rc;
}

/* Broadcast is a pipelined chain root -> root+1 -> ... -> root-1: each rank
 * forwards every segment the moment it has it. */
static int broadcast_steps(rr_ring *ring, char *buf, size_t nbytes, int root, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    const size_t seg = ring->segment;
    rr_transport *t = ring->transport;
    const int receives = r != root, forwards = mod(r + 1, N) != root;
    size_t sent = 0, rcvd = receives ? 0 : nbytes;
    while ((forwards && sent < nbytes) || rcvd < nbytes) {
        size_t s_end = (sent / seg + 1) * seg;
        if (s_end > rcvd) s_end = rcvd;
        size_t r_end = (rcvd / seg + 1) * seg;
        if (r_end > nbytes) r_end = nbytes;
        size_t ds = 0, dr = 0;
        int rc = rr_transport_exchange(t, RR_SENT_RING, buf + sent, forwards ? s_end - sent : 0, &ds, buf + rcvd,
                                       r_end - rcvd, &dr, err);
        if (rc != RR_OK) return fail(ring, rc, err);
        sent += ds;
        rcvd += dr;
    }
    return RR_OK;
}

/* With a device the chain runs on the mirror: the root's bytes come down
 * in one copy first, every other rank's go up in one copy after. */
int rr_broadcast(rr_ring *ring, rr_device *dev, void *buf, size_t nbytes, int root, rr_error *err)
{
    if (ring->size == 1 || nbytes == 0) return RR_OK;
    if (!dev) return broadcast_steps(ring, buf, nbytes, root, err);
    const int is_root = ring->rank == root;
    int rc = dev->ops->begin(dev, err);
    if (rc == RR_OK) rc = rr_device_reserve(dev, nbytes, err);
    if (rc == RR_OK && is_root) rc = rr_dev_to_host(dev, dev->mirror, buf, nbytes, err);
    if (rc == RR_OK && is_root) rc = rr_device_sync(dev, err);
    if (rc != RR_OK) return fail(ring, rc, err);
    if ((rc = broadcast_steps(ring, dev->mirror, nbytes, root, err)) != RR_OK) return rc;
    if (is_root) return RR_OK;
    rc = rr_dev_to_device(dev, buf, dev->mirror, nbytes, err);
    if (rc == RR_OK) rc = rr_device_sync(dev, err);
    return rc == RR_OK ? RR_OK : fail(ring, rc, err);
}

/* A ring allgather of variable-length blobs: at step k rank r forwards the
 * blob of rank (r - k) and receives the blob of rank (r - k - 1). Each blob
 * travels as one frame, its length (u64) then its bytes, so a step costs one
 * hop. N-1 steps, the fewest a ring allows. */
static int ring_exchange_blobs(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                               void **all, size_t *lens, rr_error *err)
{
    const size_t len = hlen + dlen;
    const int N = ring->size, r = ring->rank;
    rr_transport *t = ring->transport;
    *all = NULL;
    /* Check our own frame before a peer can call it malformed, and before
     * any byte leaves: the ring stays in step and the others name us. */
    if (len > MAX_BLOB) {
        rr_set_error(err, RR_E_INVALID, r, "rank %d's frame of %zu bytes exceeds the %zu MiB frame cap", r, len,
                     MAX_BLOB >> 20);
        return fail(ring, RR_E_INVALID, err);
    }
    if (rr_doubling_usable(ring)) return rr_exchange_blobs_doubling(ring, head, hlen, data, dlen, all, lens, err);
    char **frame = calloc((size_t)N, sizeof *frame);
    if (!frame || !(frame[r] = malloc(8 + len))) goto oom;
    uint64_t len64 = len;
    memcpy(frame[r], &len64, 8);
    memcpy(frame[r] + 8, head, hlen);
    if (dlen) memcpy(frame[r] + 8 + hlen, data, dlen);
    lens[r] = len;
    for (int k = 0; k < N - 1; k++) {
        const int s = mod(r - k, N), q = mod(r - k - 1, N);
        const size_t out_len = 8 + lens[s];
        uint64_t in_len = 0;
        size_t sent = 0, rcvd = 0, want = 8;
        int framed = 0; /* the peer's length is in and its frame allocated */
        while (sent < out_len || rcvd < want) {
            char *rp = rcvd < 8 ? (char *)&in_len + rcvd : frame[q] + rcvd;
            size_t ds = 0, dr = 0;
            int rc = rr_transport_exchange(t, RR_SENT_BLOBS, frame[s] + sent, out_len - sent, &ds, rp, want - rcvd, &dr, err);
            if (rc != RR_OK) { fail(ring, rc, err); goto out; }
            sent += ds;
            rcvd += dr;
            if (rcvd == 8 && !framed) { /* once: a zero-length frame keeps want at 8 */
                framed = 1;
                if (in_len > MAX_BLOB) {
                    rr_set_error(err, RR_E_PROTOCOL, q, "malformed header from rank %d: %llu bytes", q,
                                 (unsigned long long)in_len);
                    fail(ring, RR_E_PROTOCOL, err);
                    goto out;
                }
                if (!(frame[q] = malloc(8 + in_len))) goto oom;
                memcpy(frame[q], &in_len, 8);
                want = 8 + (size_t)in_len;
                lens[q] = (size_t)in_len;
            }
        }
    }
    size_t total = 0;
    for (int i = 0; i < N; i++) total += lens[i];
    if (!(*all = malloc(total ? total : 1))) goto oom;
    for (size_t i = 0, at = 0; i < (size_t)N; at += lens[i], i++) memcpy((char *)*all + at, frame[i] + 8, lens[i]);
    for (int i = 0; i < N; i++) free(frame[i]);
    free(frame);
    return RR_OK;
oom:
    rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
out:
    if (frame) for (int i = 0; i < N; i++) free(frame[i]);
    free(frame);
    free(*all);
    *all = NULL;
    return err->code;
}

/* The arena's blobs of the last round, copied out as rr_exchange_blobs gives them. */
static int copy_arena_blobs(rr_ring *ring, void **all, size_t *lens, rr_error *err)
{
    size_t total = 0;
    for (int i = 0; i < ring->size; i++) {
        rr_arena_blob(ring->arena, i, &lens[i]);
        total += lens[i];
    }
    if (!(*all = malloc(total ? total : 1))) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    for (size_t i = 0, at = 0; i < (size_t)ring->size; at += lens[i], i++)
        memcpy((char *)*all + at, rr_arena_blob(ring->arena, (int)i, &lens[i]), lens[i]);
    return RR_OK;
}

/* One arena round (host_arena.h) when the ring has one switched on:
 * *done says every blob fitted and the round's blobs are in the arena;
 * otherwise every rank moves this round's blobs around the ring instead. */
static int arena_round(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen, int *done,
                       rr_error *err)
{
    *done = 0;
    if (!ring->arena || !ring->use_arena) return RR_OK;
    int rc = rr_arena_round(ring->arena, ring->transport, head, hlen, data, dlen, done, err);
    return rc == RR_OK ? RR_OK : fail(ring, rc, err);
}

int rr_exchange_blobs(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                      void **all, size_t *lens, rr_error *err)
{
    int in_arena = 0;
    *all = NULL;
    if (hlen + dlen <= MAX_BLOB) { /* a bigger frame fails in the ring pass, naming this rank */
        int rc = arena_round(ring, head, hlen, data, dlen, &in_arena, err);
        if (rc != RR_OK) return rc;
    }
    if (in_arena) return copy_arena_blobs(ring, all, lens, err);
    return ring_exchange_blobs(ring, head, hlen, data, dlen, all, lens, err);
}

/* Small allreduce: every rank's header and data meet in the host arena, or
 * travel in one ring pass; then each rank reduces all the data itself, in
 * rank order, so every rank gets the same bits (whichever way they met, and
 * whichever way the arena reduces: host_arena.h's modes). When some rank's
 * header differs from ours nothing is reduced: *agreed is 0 and *all/lens
 * hold every blob for the caller to explain the mismatch. */
int rr_allreduce_small(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                       void *out, rr_dtype dtype, rr_op op, int *agreed, void **all, size_t *lens,
                       rr_error *err)
{
    const int N = ring->size;
    const size_t esize = rr_dtype_size(dtype);
    *agreed = 0;
    *all = NULL;
    if (esize == 0 || dlen % esize) {
        rr_set_error(err, RR_E_INVALID, -1, "unsupported dtype %d or ragged buffer", (int)dtype);
        return err->code;
    }
    const int mean = op == RR_AVG && rr_avg_is_mean(dtype);
    const int mode = ring->arena ? ring->use_arena : 0; /* rr_arena_mode, 0: no arena */
    /* The arena first (every rank on one host); else doubling where the transport reaches any rank. */
    if (!mean && rr_doubling_usable(ring) && !mode)
        return rr_allreduce_doubling(ring, head, hlen, data, dlen, out, dtype, op, agreed, all, lens, err);
    int in_arena = 0, rc = RR_OK;
    if (hlen + dlen <= MAX_BLOB) {
        if (mode) rr_arena_offer_split(ring->arena, rr_arena_wants_split(mode, N, dlen));
        rc = arena_round(ring, head, hlen, data, dlen, &in_arena, err);
    }
    if (rc == RR_OK && !in_arena) rc = ring_exchange_blobs(ring, head, hlen, data, dlen, all, lens, err);
    if (rc != RR_OK) return rc;
    const char **blob = malloc(sizeof *blob * (size_t)N);
    if (!blob) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    for (size_t i = 0, at = 0; i < (size_t)N; at += lens[i], i++)
        blob[i] = in_arena ? rr_arena_blob(ring->arena, (int)i, &lens[i]) : (const char *)*all + at;
    int same = 1;
    for (int i = 0; i < N && same; i++) same = lens[i] == hlen + dlen && memcmp(blob[i], head, hlen) == 0;
    if (!same) {
        free(blob);
        return in_arena ? copy_arena_blobs(ring, all, lens, err) : RR_OK;
    }
    *agreed = 1;
    if (in_arena && rr_arena_all_split(ring->arena)) {
        free(blob);
        rc = rr_arena_allreduce_split(ring->arena, ring->transport, hlen, data, dlen, out, dtype, op, err);
        return rc == RR_OK ? RR_OK : fail(ring, rc, err);
    }
    if (in_arena && mode == RR_ARENA_COPY) { /* the first version, to compare */
        memcpy(out, blob[0] + hlen, dlen);
        for (int i = 1; i < N; i++) {
            if (mean) rr_mean_fold(out, blob[i] + hlen, out, dlen / esize, dtype, i + 1);
            else rr_reduce(out, blob[i] + hlen, dlen / esize, dtype, op);
        }
        if (op == RR_AVG && !mean) rr_divide(out, dlen / esize, dtype, N);
    } else {
        /* Straight into out, no copy first; our own term from our input
         * (warm in this core's cache) unless it overlaps out. */
        const char *mine = (const char *)data, *o = out;
        const int apart = !dlen || mine + dlen <= o || o + dlen <= mine;
        for (int i = 0; i < N; i++) blob[i] = i == ring->rank && apart ? mine : blob[i] + hlen;
        if (in_arena) rr_arena_fold(out, (const void *const *)blob, N, apart ? ring->rank : -1, dlen / esize, dtype, op);
        else rr_reduce_in_order(out, (const void *const *)blob, N, dlen / esize, dtype, op);
    }
    free(blob);
    free(*all);
    *all = NULL;
    return RR_OK;
}
