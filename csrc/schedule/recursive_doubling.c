/* Recursive doubling, for small operations over a transport that reaches any
 * rank (transport.h's sendrecv).
 *
 * P is the largest power of two <= N, and E = N - P ranks are extra:
 *
 *   fold     rank 2i (i < E) hands what it holds to 2i+1, and waits.
 *   rounds   the P others, renumbered v = 0 .. P-1 (2i+1 -> i, r >= 2E ->
 *            r - E), swap everything they hold with v ^ 1, then v ^ 2,
 *            v ^ 4, ...: after the round with v ^ m each holds what its
 *            group of 2m holds, after log2 P rounds what everyone holds.
 *   unfold   2i+1 hands the result back to 2i.
 *
 *       N = 4   round 1: 0 <-> 1, 2 <-> 3    round 2: 0 <-> 2, 1 <-> 3
 *       N = 3   fold 0 -> 1    round 1: 1 <-> 2    unfold 1 -> 0
 *
 * Each hand-over is a bundle of the blobs this rank holds (whole blobs when
 * gathering, headers alone when reducing: they are small) with the partial
 * result packed behind it (none when gathering): one message; a partial over
 * PACK_BYTES (copying it would cost more than a message) goes apart. So every rank ends with
 * every rank's header, and a mismatch is seen, and named, alike everywhere.
 *
 * Reducing, the two partners of a round combine their partials with the
 * lower group's operand first (lower v; in the fold, 2i), so both compute
 * the same bits, and every rank ends with the same reduction tree. A rank
 * that meets a header unlike its own stops reducing and says so in its
 * bundles; partials of another length are never reduced. The rounds still
 * run to the end, so every rank learns every header.
 *
 * Bytes each rank sends, reducing: log2 P partials (the fold's pair one
 * more), against the ring small path's N-1; gathering: N-1 blobs, as the
 * ring's blob pass, in log2 P (+2) hops instead of N-1.
 */
#include "schedule/recursive_doubling.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/reduce.h"

int rr_doubling_usable(const rr_ring *ring)
{
    return ring->transport && ring->size > 1 && ring->transport->ops->sendrecv &&
           ring->small_algorithm != RR_SMALL_RING;
}

static int power_below(int n)
{
    int p = 1;
    while (p * 2 <= n) p *= 2;
    return p;
}

int rr_doubling_rounds(int size)
{
    int rounds = 0, p = power_below(size);
    while ((1 << rounds) < p) rounds++;
    return rounds + (p != size);
}

typedef struct {
    rr_ring *ring;
    int N;
    char **blob;       /* what this rank holds of rank i's blob; NULL: not yet */
    size_t *blen;
    const void *head;  /* ours: what every blob is compared to while reducing */
    size_t hlen;
    int reducing;      /* reducing, and every header so far is ours */
} doubling;

/* What one hand-over carries: the bundle, and the partial packed behind it
 * (one message) while at most PACK_BYTES, else as a second message (no copy
 * of a large partial). The receiver learns which from the bundle's flags.
 *
 *   u32 flags (REDUCING, SEPARATE), u32 count, u64 partial length,
 *   per blob: u32 rank, u64 length, bytes; then, packed: padding to 8, partial
 */
#define PACK_BYTES 16384
#define REDUCING 1u
#define SEPARATE 2u
#define ALIGN8(n) (((n) + 7) / 8 * 8)

typedef struct {
    char *msg;         /* what to free */
    char *part;        /* the partial in it (writable: a combine may reduce into it) */
    size_t plen;
} incoming;

static int make_bundle(const doubling *d, const void *part, size_t plen, char **out, size_t *len, int *separate)
{
    size_t total = 16;
    uint32_t count = 0;
    for (int i = 0; i < d->N; i++)
        if (d->blob[i]) total += 12 + d->blen[i], count++;
    *separate = plen > PACK_BYTES;
    const size_t at_part = ALIGN8(total);
    if (!*separate && plen) total = at_part + plen;
    char *b = malloc(total), *at = b + 16;
    if (!b) return -1;
    const uint32_t flags = (d->reducing ? REDUCING : 0) | (*separate ? SEPARATE : 0);
    const uint64_t plen64 = plen;
    memcpy(b, &flags, 4);
    memcpy(b + 4, &count, 4);
    memcpy(b + 8, &plen64, 8);
    for (int i = 0; i < d->N; i++) {
        if (!d->blob[i]) continue;
        const uint32_t r = (uint32_t)i;
        const uint64_t n = d->blen[i];
        memcpy(at, &r, 4);
        memcpy(at + 4, &n, 8);
        memcpy(at + 12, d->blob[i], d->blen[i]);
        at += 12 + d->blen[i];
    }
    if (!*separate && plen) memcpy(b + at_part, part, plen);
    *out = b;
    *len = total;
    return 0;
}

/* Takes the blobs of a bundle; says where its partial is (*separate: in the
 * next message). */
static int take_bundle(doubling *d, int peer, char *b, size_t len, incoming *in, int *separate, rr_error *err)
{
    uint32_t flags, count;
    uint64_t plen;
    if (len < 16) goto malformed;
    memcpy(&flags, b, 4);
    memcpy(&count, b + 4, 4);
    memcpy(&plen, b + 8, 8);
    if (!(flags & REDUCING)) d->reducing = 0;
    *separate = (flags & SEPARATE) != 0;
    size_t at = 16;
    for (uint32_t k = 0; k < count; k++) {
        uint32_t r;
        uint64_t n;
        if (len - at < 12) goto malformed;
        memcpy(&r, b + at, 4);
        memcpy(&n, b + at + 4, 8);
        at += 12;
        if (r >= (uint32_t)d->N || n > len - at) goto malformed;
        if (!d->blob[r]) {
            if (!(d->blob[r] = malloc(n ? n : 1))) {
                rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
                return err->code;
            }
            memcpy(d->blob[r], b + at, n);
            d->blen[r] = n;
            if (n != d->hlen || memcmp(d->blob[r], d->head, n) != 0) d->reducing = 0;
        }
        at += n;
    }
    if (*separate || plen == 0) {
        if (at != len) goto malformed;
        in->part = NULL;
        in->plen = 0;
        return RR_OK;
    }
    if (ALIGN8(at) > len || len - ALIGN8(at) != plen) goto malformed;
    in->part = b + ALIGN8(at);
    in->plen = plen;
    return RR_OK;
malformed:
    rr_set_error(err, RR_E_PROTOCOL, peer, "malformed bundle of %zu bytes from rank %d", len, peer);
    return err->code;
}

/* One hand-over with peer: send our bundle and partial (acc, alen bytes;
 * nothing once not reducing) if `give`, take theirs if `take` (*in: their
 * partial, in a malloc'ed message; all NULL when not taking). A partial too
 * large to pack follows in a second exchange, once both sides know from the
 * bundles what the other sends (so no send waits for a receive never posted). */
static int hand_over(doubling *d, int peer, int depth, int give, int take, const void *acc, size_t alen,
                     incoming *in, rr_error *err)
{
    char *bundle = NULL;
    size_t blen = 0;
    int mine_apart = 0, theirs_apart = 0;
    *in = (incoming){0};
    if (!d->reducing) alen = 0;
    if (give && make_bundle(d, acc, alen, &bundle, &blen, &mine_apart) != 0) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    const void *sbuf = bundle;
    void *rbuf = NULL;
    size_t rlen = 0;
    rr_transport *t = d->ring->transport;
    int rc = rr_transport_sendrecv(t, RR_SENT_BLOBS, peer, depth, &sbuf, &blen, give, &rbuf, &rlen, take, err);
    free(bundle);
    if (rc != RR_OK) return rc;
    if (take) {
        in->msg = rbuf;
        rc = take_bundle(d, peer, rbuf, rlen, in, &theirs_apart, err);
    }
    if (rc == RR_OK && (mine_apart || theirs_apart)) {
        free(in->msg);
        *in = (incoming){0};
        rbuf = NULL;
        rc = rr_transport_sendrecv(t, RR_SENT_BLOBS, peer, depth, &acc, &alen, mine_apart, &rbuf, &rlen,
                                   theirs_apart, err);
        if (rc == RR_OK && theirs_apart) *in = (incoming){.msg = rbuf, .part = rbuf, .plen = rlen};
    }
    if (rc != RR_OK) {
        free(in->msg);
        *in = (incoming){0};
    }
    return rc;
}

/* The partial result: starts as our data, then lives in dst or in a
 * partner's message (owned), whichever the last combine wrote. dst is out,
 * or a spare buffer when out is the data itself: a mismatch found in a late
 * round must leave the caller's data as it was (it may take the ring next). */
typedef struct {
    const char *acc;
    char *owned;
    void *out, *dst, *spare;
    size_t len, count;
    rr_dtype dtype;
    rr_op op;
} partial;

/* acc = lower op upper, where ours is the lower operand if mine_first. */
static void combine(doubling *d, partial *p, incoming in, int mine_first)
{
    if (p->len == 0) { /* nothing to reduce: the headers decide */
        free(in.msg);
        return;
    }
    if (!d->reducing || !in.part || in.plen != p->len) { /* a header differs somewhere: never reduce */
        d->reducing = 0;
        free(in.msg);
        return;
    }
    if (mine_first) {
        if (p->acc != (const char *)p->dst) memmove(p->dst, p->acc, p->len); /* out may overlap x: numpy views */
        rr_reduce(p->dst, in.part, p->count, p->dtype, p->op);
        free(in.msg);
        free(p->owned);
        p->owned = NULL;
        p->acc = p->dst;
    } else {
        rr_reduce(in.part, p->acc, p->count, p->dtype, p->op);
        free(p->owned);
        p->owned = in.msg;
        p->acc = in.part;
    }
}

/* The fold, the rounds and the unfold (see the top of the file). A wait's
 * depth is its stage (fold 0, rounds 1 .. R, unfold R + 1): a partner late
 * for stage s may be stuck in up to s earlier waits (transport.h). */
static int run(doubling *d, partial *p, rr_error *err)
{
    const int N = d->N, r = d->ring->rank, P = power_below(N), E = N - P;
    const int unfold = rr_doubling_rounds(P) + 1;
    incoming in;
    int rc;
    if (r < 2 * E && r % 2 == 0) { /* extra: hand over, then take the result */
        if ((rc = hand_over(d, r + 1, 0, 1, 0, p->acc, p->len, &in, err)) != RR_OK) return rc;
        if ((rc = hand_over(d, r + 1, unfold, 0, 1, NULL, 0, &in, err)) != RR_OK) return rc;
        if (d->reducing && in.part && in.plen == p->len) {
            p->owned = in.msg; /* the result: copied out once every header is checked */
            p->acc = in.part;
        } else {
            if (p->len) d->reducing = 0;
            free(in.msg);
        }
        return RR_OK;
    }
    if (r < 2 * E) {
        if ((rc = hand_over(d, r - 1, 0, 0, 1, NULL, 0, &in, err)) != RR_OK) return rc;
        combine(d, p, in, 0);
    }
    const int v = r < 2 * E ? r / 2 : r - E;
    for (int m = 1, stage = 1; m < P; m *= 2, stage++) {
        const int pv = v ^ m, peer = pv < E ? 2 * pv + 1 : pv + E;
        if ((rc = hand_over(d, peer, stage, 1, 1, p->acc, p->len, &in, err)) != RR_OK) return rc;
        combine(d, p, in, v < pv);
    }
    if (r < 2 * E) return hand_over(d, r - 1, unfold, 1, 0, p->acc, p->len, &in, err);
    return RR_OK;
}

/* Every rank's blob back to back in *all, rank order, lens[i] bytes each. */
static int collect(doubling *d, void **all, size_t *lens, rr_error *err)
{
    size_t total = 0;
    for (int i = 0; i < d->N; i++) {
        if (!d->blob[i]) {
            rr_set_error(err, RR_E_PROTOCOL, i, "recursive doubling ended without rank %d's blob", i);
            return err->code;
        }
        total += lens[i] = d->blen[i];
    }
    char *at = *all = malloc(total ? total : 1);
    if (!at) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    for (int i = 0; i < d->N; at += lens[i], i++) memcpy(at, d->blob[i], lens[i]);
    return RR_OK;
}

static int start(doubling *d, rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                 int reducing, rr_error *err)
{
    d->ring = ring;
    d->N = ring->size;
    d->head = head;
    d->hlen = hlen;
    d->reducing = reducing;
    d->blob = calloc((size_t)d->N, sizeof *d->blob);
    d->blen = calloc((size_t)d->N, sizeof *d->blen);
    const size_t own = reducing ? hlen : hlen + dlen; /* gathering, our blob carries the data */
    char *mine = d->blob && d->blen ? malloc(own ? own : 1) : NULL;
    if (!mine) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    memcpy(mine, head, hlen);
    if (own > hlen) memcpy(mine + hlen, data, dlen);
    d->blob[ring->rank] = mine;
    d->blen[ring->rank] = own;
    return RR_OK;
}

static void finish(doubling *d)
{
    if (d->blob)
        for (int i = 0; i < d->N; i++) free(d->blob[i]);
    free(d->blob);
    free(d->blen);
}

int rr_exchange_blobs_doubling(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen,
                               void **all, size_t *lens, rr_error *err)
{
    doubling d = {0};
    partial p = {0};
    *all = NULL;
    int rc = start(&d, ring, head, hlen, data, dlen, 0, err);
    if (rc == RR_OK) rc = run(&d, &p, err);
    if (rc == RR_OK) rc = collect(&d, all, lens, err);
    finish(&d);
    if (rc != RR_OK) ring->transport->ops->abort(ring->transport, err);
    return rc;
}

int rr_allreduce_doubling(rr_ring *ring, const void *head, size_t hlen, const void *data, size_t dlen, void *out,
                          rr_dtype dtype, rr_op op, int *agreed, void **all, size_t *lens, rr_error *err)
{
    doubling d = {0};
    const size_t esize = rr_dtype_size(dtype);
    partial p = {.acc = data, .out = out, .dst = out, .len = dlen, .count = esize ? dlen / esize : 0,
                 .dtype = dtype, .op = op};
    *agreed = 0;
    *all = NULL;
    int rc = start(&d, ring, head, hlen, data, dlen, 1, err);
    if (rc == RR_OK && out == data && !(p.dst = p.spare = malloc(dlen ? dlen : 1))) {
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        rc = err->code;
    }
    if (rc == RR_OK) rc = run(&d, &p, err);
    if (rc == RR_OK) {
        for (int i = 0; i < d.N && d.reducing; i++)
            if (!d.blob[i] || d.blen[i] != hlen || memcmp(d.blob[i], head, hlen) != 0) d.reducing = 0;
        if (d.reducing) {
            *agreed = 1;
            if (p.acc != (const char *)out) memcpy(out, p.acc, dlen);
            if (op == RR_AVG) rr_divide(out, p.count, dtype, d.N);
        } else {
            rc = collect(&d, all, lens, err);
        }
    }
    free(p.owned);
    free(p.spare);
    finish(&d);
    if (rc != RR_OK) ring->transport->ops->abort(ring->transport, err);
    return rc;
}
