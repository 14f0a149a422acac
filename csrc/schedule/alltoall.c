/* Alltoall over the ring: every rank sends block d of its input to rank d.
 *
 * A ring link only reaches the next rank, so a block travels (d - o) mod N
 * hops from its origin o to its destination d, forwarded by the ranks in
 * between. N-1 steps k = 0 .. N-2 of one formula:
 *
 *     at step k, rank r sends the blocks of origin r - k that are still
 *     travelling (destinations r+1 .. r-k-1+N, nearest first),
 *     and receives those of origin r - k - 1 (destinations r .. r-k-2+N)
 *
 * The first block received at step k is addressed to r: it lands in the
 * output. The rest is exactly what r sends at step k+1, so, as in the
 * allreduce ring, each segment is forwarded as soon as it has arrived while
 * the next one is on the wire. Rank r's own block is copied locally.
 *
 * Example, N = 4, rank 0 (block o->d = origin o's rows for rank d):
 *
 *   k  sends               receives            keeps
 *   0  0->1, 0->2, 0->3    3->0, 3->1, 3->2    3->0
 *   1  3->1, 3->2          2->0, 2->1          2->0
 *   2  2->1                1->0                1->0
 *
 * Each rank sends sum over k of its step-k bundle: with equal blocks of S/N
 * bytes, (N-1)/2 * S, against (N-1)/N * S for direct sends; the price of
 * using ring links only, which every transport (sockets, shared-memory
 * links, MPI) already provides.
 *
 * Forwarded blocks wait in two transit buffers used in turn (step k's
 * receive fills transit[k % 2], step k+1's send drains it), so a receive into
 * transit[k % 2] waits until step k-1's send has drained it. Extra memory:
 * twice the largest bundle a rank forwards, never more than 2 * N-1 blocks.
 *
 * Both ends of a link cut a step's bundle into the same windows (each block
 * in segments from its start), so over MPI every window is one message.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "schedule/ring.h"

static int mod(int a, int n) { return ((a % n) + n) % n; }

typedef struct {
    int step;      /* k */
    int piece;     /* the block for origin + piece, piece = k+1 .. N-1 */
    size_t off;    /* bytes of that block moved */
} cursor;

typedef struct {
    int N, r;
    const size_t *bytes;   /* N*N: bytes[o * N + d], origin o's block for d */
    const char *src;
    char *dst;
    size_t *in_off;        /* N: where our block for d starts in src */
    size_t *out_off;       /* N: where origin o's block for us starts in dst */
    char *transit[2];
} plan;

static size_t block(const plan *p, int o, int piece) { return p->bytes[(size_t)o * p->N + mod(o + piece, p->N)]; }

/* Offset of a block in the transit buffer: the bundle's blocks past `first`,
 * back to back. */
static size_t transit_off(const plan *p, int o, int first, int piece)
{
    size_t at = 0;
    for (int i = first; i < piece; i++) at += block(p, o, i);
    return at;
}

/* The sender at step k reads origin r - k's blocks: its own input at k = 0,
 * else what step k-1 received into transit[(k-1) % 2]. */
static const char *send_ptr(const plan *p, const cursor *c)
{
    const int o = mod(p->r - c->step, p->N);
    if (c->step == 0) return p->src + p->in_off[mod(o + c->piece, p->N)] + c->off;
    return p->transit[(c->step - 1) % 2] + transit_off(p, o, c->step + 1, c->piece) + c->off;
}

/* The receiver at step k writes origin r-k-1's block for r into the output,
 * the blocks still travelling into transit[k % 2]. */
static char *recv_ptr(const plan *p, const cursor *c)
{
    const int o = mod(p->r - c->step - 1, p->N);
    if (c->piece == c->step + 1) return p->dst + p->out_off[o] + c->off;
    return p->transit[c->step % 2] + transit_off(p, o, c->step + 2, c->piece) + c->off;
}

/* Skips finished and empty blocks; step N-1 means done. */
static void settle(const plan *p, cursor *c, int origin_lag)
{
    while (c->step < p->N - 1) {
        const int o = mod(p->r - c->step - origin_lag, p->N);
        if (c->piece < p->N && c->off < block(p, o, c->piece)) return;
        if (c->piece < p->N && c->off == block(p, o, c->piece)) { c->piece++; c->off = 0; continue; }
        c->step++;
        c->piece = c->step + 1;
        c->off = 0;
    }
}

/* The end of the window holding byte `off` of a block of `len` bytes. */
static size_t window_end(size_t off, size_t len, size_t seg)
{
    size_t end = (off / seg + 1) * seg;
    return end < len ? end : len;
}

int rr_alltoall(rr_ring *ring, const void *src, void *dst, const size_t *bytes, rr_error *err)
{
    const int N = ring->size, r = ring->rank;
    const size_t seg = ring->segment;
    plan p = {.N = N, .r = r, .bytes = bytes, .src = src, .dst = dst};
    p.in_off = malloc(sizeof(size_t) * (size_t)N);
    p.out_off = malloc(sizeof(size_t) * (size_t)N);
    size_t biggest = 0; /* the largest bundle this rank keeps for forwarding */
    int rc = RR_OK;
    if (!p.in_off || !p.out_off) goto oom;
    size_t in_at = 0, out_at = 0;
    for (int i = 0; i < N; i++) {
        p.in_off[i] = in_at;
        in_at += bytes[(size_t)r * N + i];
        p.out_off[i] = out_at;
        out_at += bytes[(size_t)i * N + r];
    }
    memcpy((char *)dst + p.out_off[r], (const char *)src + p.in_off[r], bytes[(size_t)r * N + r]);
    if (N == 1) goto out;
    for (int k = 0; k < N - 2; k++) {
        const int o = mod(r - k - 1, N);
        size_t b = transit_off(&p, o, k + 2, N);
        if (b > biggest) biggest = b;
    }
    if (biggest) {
        p.transit[0] = malloc(biggest);
        p.transit[1] = N > 3 ? malloc(biggest) : NULL; /* N = 3 forwards at step 0 only */
        if (!p.transit[0] || (N > 3 && !p.transit[1])) goto oom;
    }

    rr_transport *t = ring->transport;
    cursor s = {0, 1, 0}, v = {0, 1, 0}; /* send, receive */
    for (;;) {
        settle(&p, &s, 0);
        settle(&p, &v, 1);
        if (s.step >= N - 1 && v.step >= N - 1) break;
        const char *sp = NULL;
        size_t sl = 0;
        if (s.step < N - 1) {
            const size_t end = window_end(s.off, block(&p, mod(r - s.step, N), s.piece), seg);
            /* A forwarded window leaves once it has wholly arrived. */
            const int arrived = s.step == 0 || v.step > s.step - 1 ||
                                (v.step == s.step - 1 && (v.piece > s.piece || (v.piece == s.piece && v.off >= end)));
            if (arrived) { sp = send_ptr(&p, &s); sl = end - s.off; }
        }
        char *rp = NULL;
        size_t rl = 0;
        if (v.step < N - 1) {
            /* transit[k % 2] is free once step k-1's send has drained it. */
            const int into_transit = v.piece != v.step + 1;
            if (!into_transit || s.step >= v.step) {
                rp = recv_ptr(&p, &v);
                rl = window_end(v.off, block(&p, mod(r - v.step - 1, N), v.piece), seg) - v.off;
            }
        }
        size_t sent = 0, rcvd = 0;
        rc = rr_transport_exchange(t, RR_SENT_ALLTOALL, sp, sl, &sent, rp, rl, &rcvd, err);
        if (rc != RR_OK) { t->ops->abort(t, err); goto out; }
        s.off += sent;
        v.off += rcvd;
    }
    goto out;
oom:
    rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
    rc = err->code;
    if (ring->transport) ring->transport->ops->abort(ring->transport, err);
out:
    free(p.in_off);
    free(p.out_off);
    free(p.transit[0]);
    free(p.transit[1]);
    return rc;
}
