/* The ring by Cross Memory Attach: see cma.h. */
#define _GNU_SOURCE
#include "schedule/cma.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#include "kernels/reduce.h"
#include "memory/shared_region.h"

/* One token on a link: aligned like every element in the mapping. */
#define TOKEN 64
#define TOKEN_MAGIC 0x52524d4143000000ull /* "RRCMA" and the step below it */

typedef struct {
    uint64_t tag;      /* TOKEN_MAGIC | step */
    uint64_t src, buf; /* the sender's buffers (first token of an operation) */
    /* Where src and buf lie in the sender's shared regions (shared_region.h;
     * id 0: not in one): the reader may map them (peer_map.h) and read there. */
    uint64_t src_region, buf_region, src_offset, buf_offset;
    int32_t src_fd, buf_fd;
} token;
_Static_assert(sizeof(token) == TOKEN, "a token is 64 bytes");

static int mod(int a, int n) { return ((a % n) + n) % n; }

int rr_cma_wanted(const rr_ring *ring, const size_t *len)
{
    if (!ring->zero_copy || ring->cma_pid <= 0 || !ring->transport->ops->prev_alive) return 0;
    for (int c = 0; c < ring->size; c++) if (len[c] >= RR_CMA_MIN_CHUNK) return 1;
    return 0;
}

int rr_cma_probe(int pid, uint64_t addr, const void *expect, size_t n)
{
    char got[64];
    if (pid <= 0 || n > sizeof got) return 0;
    struct iovec l = {got, n}, r = {(void *)(uintptr_t)addr, n};
    return process_vm_readv(pid, &l, 1, &r, 1, 0) == (ssize_t)n && memcmp(got, expect, n) == 0;
}

static int fail(rr_ring *ring, int code, rr_error *err)
{
    ring->transport->ops->abort(ring->transport, err);
    return code;
}

/* extent: the bytes of src and buf the operation spans (0 on later tokens). */
static int put_token(rr_transport *t, int step, const void *src, const void *buf, size_t extent, rr_error *err)
{
    token tok = {.tag = TOKEN_MAGIC | (uint64_t)step, .src = (uintptr_t)src, .buf = (uintptr_t)buf};
    if (extent) {
        rr_region_ref s = rr_region_find(src, extent), b = rr_region_find(buf, extent);
        tok.src_region = s.id;
        tok.src_offset = s.offset;
        tok.src_fd = s.fd;
        tok.buf_region = b.id;
        tok.buf_offset = b.offset;
        tok.buf_fd = b.fd;
    }
    for (;;) {
        void *w;
        if (t->ops->tx_window(t, &w) >= TOKEN) {
            memcpy(w, &tok, TOKEN);
            t->ops->tx_commit(t, TOKEN);
            return RR_OK;
        }
        /* Not wait(): it returns at a byte of room, and a token needs 64
         * (and the alignment gap before an operation's first one): that
         * spun without ever sleeping, timing out or seeing Ctrl-C. */
        int rc = t->ops->wait_drained(t, 0, err);
        if (rc != RR_OK) return rc;
    }
}

/* Waits for prev's token of `step`, without handing it back. */
static int get_token(rr_transport *t, int prev, int step, token *tok, rr_error *err)
{
    for (;;) {
        const void *p;
        if (t->ops->rx_window(t, &p) >= TOKEN) {
            memcpy(tok, p, TOKEN);
            if (tok->tag == (TOKEN_MAGIC | (uint64_t)step)) return RR_OK;
            rr_set_error(err, RR_E_PROTOCOL, prev, "rank %d sent something else than the Cross Memory Attach "
                         "token of step %d (the ranks disagree on the path?)", prev, step);
            return err->code;
        }
        int rc = t->ops->wait(t, 0, 1, err);
        if (rc != RR_OK) return rc;
    }
}

/* n bytes at `from` in prev's memory into dst. A failed read (prev gone:
 * ESRCH, or its buffers already handed back after it gave up: EFAULT) is
 * judged as prev's link closing would be, naming the rank really at fault. */
static int pull(rr_transport *t, int pid, int prev, void *dst, uintptr_t from, size_t n, rr_error *err)
{
    while (n) {
        struct iovec l = {dst, n}, r = {(void *)from, n};
        ssize_t k = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            char what[128];
            snprintf(what, sizeof what, "reading rank %d's buffer by Cross Memory Attach failed: %s", prev,
                     k < 0 ? strerror(errno) : "nothing read");
            return t->ops->prev_alive(t, what, err);
        }
        dst = (char *)dst + k;
        from += (size_t)k;
        n -= (size_t)k;
    }
    return RR_OK;
}

/* prev's buffer, mapped here when its token says it lies in a shared
 * region and the mapping succeeds, else NULL (read by process_vm_readv). */
static const char *mapped(rr_ring *ring, uint64_t id, int fd, uint64_t offset, size_t extent)
{
    if (!id || offset > SIZE_MAX - extent) return NULL;
    const char *base = rr_peer_map(&ring->peer_maps, ring->cma_pid, id, fd, (size_t)offset + extent);
    return base ? base + offset : NULL;
}

/* Step g: this rank reads chunk (r - g - 2) mod N from prev (its input at
 * the first step, its output after), reduces it with its own input (steps
 * below reduce_until, through the staging segment, which stays in cache and
 * leaves an in-place input intact) or copies it into place. Where prev's
 * buffer is mapped here (its shared region), the step reduces or copies
 * straight out of the mapping instead: the same kernels over the same
 * bytes, so the same bits, one copy fewer. Before step g
 * writes its output, next must have read what step g - 1 allowed (lockstep
 * by one token): at N = 2 that is the very chunk step g rewrites. */
int rr_cma_steps(rr_ring *ring, const char *src, char *buf, const size_t *off, const size_t *len, int g0,
                 int g1, int reduce_until, rr_dtype dtype, rr_op op, rr_error *err)
{
    const int N = ring->size, r = ring->rank, prev = mod(r - 1, N), pid = ring->cma_pid;
    const int mean = op == RR_AVG && rr_avg_is_mean(dtype);
    const size_t esize = rr_dtype_size(dtype), slice = ring->segment;
    rr_transport *t = ring->transport;
    char *staging = ring->staging;
    size_t extent = 0; /* every rank's chunk tables are alike: prev's buffers span as many bytes */
    for (int c = 0; c < N; c++) if (off[c] + len[c] > extent) extent = off[c] + len[c];
    /* Staged (ring.c): next may read our first chunk the moment the token is out. */
    int rc = ring->stage ? rr_stage_need(ring->stage, mod(r - g0 - 1, N), err) : RR_OK;
    if (rc != RR_OK) return fail(ring, rc, err);
    rc = put_token(t, g0, src, buf, extent, err);
    if (rc != RR_OK) return fail(ring, rc, err);
    /* what next reads from us, as the other paths count (the tokens, control records, are not counted) */
    rr_count_sent(t, RR_SENT_RING, RR_VIA_CMA, len[mod(r - g0 - 1, N)]);
    uintptr_t peer_src = 0, peer_buf = 0;
    const char *map_src = NULL, *map_buf = NULL; /* the same buffers mapped here, or NULL */
    int took_map = 0;
    for (int g = g0; g < g1; g++) {
        if (g > g0 && (rc = t->ops->wait_drained(t, TOKEN, err)) != RR_OK) return fail(ring, rc, err);
        token tok;
        if ((rc = get_token(t, prev, g, &tok, err)) != RR_OK) return fail(ring, rc, err);
        if (g == g0) {
            peer_src = (uintptr_t)tok.src;
            peer_buf = (uintptr_t)tok.buf;
            map_src = mapped(ring, tok.src_region, tok.src_fd, tok.src_offset, extent);
            if (g0 + 1 < g1) map_buf = mapped(ring, tok.buf_region, tok.buf_fd, tok.buf_offset, extent);
        }
        const int c = mod(r - g - 2, N);
        const uintptr_t from = (g == g0 ? peer_src : peer_buf) + off[c];
        const char *map = g == g0 ? map_src : map_buf;
        if (map) { map += off[c]; took_map = 1; }
        const int final = g == reduce_until - 1;
        if (ring->stage && (rc = rr_stage_need(ring->stage, c, err)) != RR_OK) return fail(ring, rc, err);
        for (size_t at = 0; at < len[c]; at += slice) {
            const size_t n = len[c] - at < slice ? len[c] - at : slice, count = n / esize;
            char *dst = buf + off[c] + at;
            if (g >= reduce_until) {
                if (map) memcpy(dst, map + at, n);
                else if ((rc = pull(t, pid, prev, dst, from + at, n, err)) != RR_OK) return fail(ring, rc, err);
                continue;
            }
            const char *peer = map ? map + at : staging;
            if (!map && (rc = pull(t, pid, prev, staging, from + at, n, err)) != RR_OK) return fail(ring, rc, err);
            /* The received partial holds g + 1 contributions; ours makes g + 2. */
            if (mean) rr_mean_fold(dst, src + off[c] + at, peer, count, dtype, g + 2);
            else rr_reduce3(dst, src + off[c] + at, peer, count, dtype, op);
            if (op == RR_AVG && !mean && final) rr_divide(dst, count, dtype, N);
        }
        /* Prev gives up (closing its link) before it returns: open now, it
         * was in the operation while we read, so the bytes were its data. */
        if ((rc = t->ops->prev_alive(t, NULL, err)) != RR_OK) return fail(ring, rc, err);
        t->ops->rx_consume(t, TOKEN);
        rr_count_received(t, RR_VIA_CMA, len[c]); /* read out of prev (mapped or by process_vm_readv) */
        /* Staged: a chunk final here goes up while the ring goes on. */
        if (ring->stage && g >= reduce_until - 1 && (rc = rr_stage_final(ring->stage, c, err)) != RR_OK)
            return fail(ring, rc, err);
        if (g + 1 == reduce_until) { /* the owned chunk is final (ring->phase_times, ring.h) */
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ring->phase_times[1] = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
        }
        if (g + 1 < g1) {
            if ((rc = put_token(t, g + 1, NULL, NULL, 0, err)) != RR_OK) return fail(ring, rc, err);
            rr_count_sent(t, RR_SENT_RING, RR_VIA_CMA, len[c]);
        }
    }
    /* next may still be reading our buffers: they go back to the caller
     * once it handed back every token. (Giving up instead aborts, which
     * closes our links first: next's prev_alive then refuses what it read.) */
    if ((rc = t->ops->wait_drained(t, 0, err)) != RR_OK) return fail(ring, rc, err);
    if (took_map) ring->mapped_ops++;
    return RR_OK;
}
