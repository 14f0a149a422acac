/* The per-host shared arena (see host_arena.h).
 *
 * Sleeping without a lost wake-up: a waiter reads gen, finds a slot not yet
 * published, counts itself in `sleepers` (full fence) and sleeps in
 * FUTEX_WAIT only while gen still holds what it read. A publisher stores its
 * round, bumps gen (full fence) and reads `sleepers`: either it sees the
 * sleeper and wakes it, or the sleeper's FUTEX_WAIT sees the new gen and
 * returns at once. With no sleeper, publishing costs no system call.
 */
#define _GNU_SOURCE
#include "schedule/host_arena.h"

#include "kernels/reduce.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define LINE 64
/* How long one futex sleep lasts at most: between sleeps the transport is
 * asked whether a peer was lost, so a dead peer is noticed within this. */
#define SLEEP_MS 10

typedef struct {
    _Atomic uint64_t v;
    char pad[LINE - 8];
} line;

/* A rank's round line: the last round it published and what it offered with
 * it, stored before v (release). The offer of round s sits in split[s % 2]
 * for the reason the blob of round s sits in buffer s % 2: a rank still
 * reading round s's offers has not published round s + 1, so nobody
 * publishes round s + 2 before it is done. */
typedef struct {
    _Atomic uint64_t v;
    uint64_t split[2];
    char pad[LINE - 24];
} round_line;
_Static_assert(sizeof(round_line) == LINE, "a round line is one cache line (the file's layout)");

typedef struct {
    char magic[8];
    char nonce[32];     /* written and checked by ringreduce/shm.py */
    char pad[LINE - 40];
    line gen;           /* bumped by every publish: the futex word (low 32 bits) */
    line sleepers;      /* ranks in FUTEX_WAIT or about to be */
} arena_header;

struct rr_arena {
    arena_header *hdr;
    round_line *round;    /* round[i]: the last round rank i published */
    unsigned char *bufs;  /* 2 per rank, `stride` bytes apart */
    size_t slot, stride, mapped;
    int rank, size, spin;
    uint64_t current;     /* the round this rank last took part in */
    int offer;            /* the split offered with the next round */
};

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
static size_t rounds_offset(void) { return round_up(sizeof(arena_header), LINE); }
static size_t bufs_offset(int size) { return round_up(rounds_offset() + (size_t)size * sizeof(round_line), PAGE); }
static size_t stride_of(size_t slot_bytes) { return round_up(8 + slot_bytes, LINE); }

size_t rr_arena_file_bytes(int size, size_t slot_bytes)
{
    return bufs_offset(size) + 2 * (size_t)size * stride_of(slot_bytes);
}

rr_arena *rr_arena_map(int fd, int rank, int size, size_t slot_bytes, int spin, rr_error *err)
{
    struct stat st;
    const size_t want = rr_arena_file_bytes(size, slot_bytes);
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != want) {
        rr_set_error(err, RR_E_INVALID, -1, "host arena: file is not %zu bytes", want);
        close(fd);
        return NULL;
    }
    void *p = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd); /* the mapping keeps the file alive */
    if (p == MAP_FAILED) {
        rr_set_error(err, RR_E_SYSTEM, -1, "host arena: mmap failed: %s", strerror(errno));
        return NULL;
    }
    rr_arena *a = calloc(1, sizeof *a);
    if (!a || memcmp(p, RR_ARENA_MAGIC, 8) != 0) {
        if (a) rr_set_error(err, RR_E_PROTOCOL, -1, "host arena: not a ringreduce arena file");
        else rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        munmap(p, want);
        free(a);
        return NULL;
    }
    a->hdr = p;
    a->round = (round_line *)((char *)p + rounds_offset());
    a->bufs = (unsigned char *)p + bufs_offset(size);
    a->slot = slot_bytes;
    a->stride = stride_of(slot_bytes);
    a->mapped = want;
    a->rank = rank;
    a->size = size;
    a->spin = spin > 0 ? spin : 0;
    a->current = atomic_load_explicit(&a->round[rank].v, memory_order_relaxed);
    return a;
}

void rr_arena_unmap(rr_arena *a)
{
    if (!a) return;
    munmap(a->hdr, a->mapped);
    free(a);
}

size_t rr_arena_slot_bytes(const rr_arena *a) { return a->slot; }

static unsigned char *buffer(const rr_arena *a, int i, uint64_t round)
{
    return a->bufs + ((size_t)i * 2 + (size_t)(round & 1)) * a->stride;
}

const void *rr_arena_blob(const rr_arena *a, int i, size_t *len)
{
    const unsigned char *b = buffer(a, i, a->current);
    uint64_t n;
    memcpy(&n, b, 8);
    *len = (size_t)n;
    return b + 8;
}

static _Atomic uint32_t *futex_word(rr_arena *a) { return (_Atomic uint32_t *)&a->hdr->gen.v; }

static void publish(rr_arena *a, uint64_t round)
{
    a->round[a->rank].split[round & 1] = (uint64_t)a->offer;
    a->offer = 0;
    atomic_store_explicit(&a->round[a->rank].v, round, memory_order_release);
    atomic_fetch_add_explicit(futex_word(a), 1, memory_order_seq_cst);
    if (atomic_load_explicit(&a->hdr->sleepers.v, memory_order_seq_cst))
        syscall(SYS_futex, futex_word(a), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Sleeps until gen moves from `seen` (or SLEEP_MS pass). */
static void sleep_on(rr_arena *a, uint32_t seen)
{
    atomic_fetch_add_explicit(&a->hdr->sleepers.v, 1, memory_order_seq_cst);
    if (atomic_load_explicit(futex_word(a), memory_order_seq_cst) == seen) {
        struct timespec ts = {0, SLEEP_MS * 1000000L};
        syscall(SYS_futex, futex_word(a), FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    atomic_fetch_sub_explicit(&a->hdr->sleepers.v, 1, memory_order_seq_cst);
}

/* Waits until rank i has published `round`. */
struct awaited {
    rr_arena *a;
    int i;
    uint64_t round;
};

/* Whether rank i has published the round: asked again by the transport
 * before it blames i, since i may publish, finish the round and leave
 * (closing its links) between our look and the transport's. */
static int has_arrived(void *p)
{
    const struct awaited *w = p;
    return atomic_load_explicit(&w->a->round[w->i].v, memory_order_acquire) >= w->round;
}

static int wait_for(rr_arena *a, rr_transport *t, int i, uint64_t round, rr_error *err)
{
    struct awaited awaited = {a, i, round};
    int spins = 0;
    int64_t start = -1;
    long long next_check = 0;
    for (;;) {
        uint32_t seen = atomic_load_explicit(futex_word(a), memory_order_acquire);
        if (atomic_load_explicit(&a->round[i].v, memory_order_acquire) >= round) return RR_OK;
        if (spins < a->spin) { /* the peer may be about to publish, perhaps on this very core */
            spins++;
            sched_yield();
            continue;
        }
        if (start < 0) {
            start = now_ms();
            next_check = start + RR_INTERRUPT_CHECK_MS;
        }
        sleep_on(a, seen);
        int64_t now = now_ms();
        if (rr_should_stop(t, now, &next_check, err)) return err->code;
        if (has_arrived(&awaited)) return RR_OK;
        int rc = t->ops->stalled(t, i, now - start, has_arrived, &awaited, err);
        if (rc != RR_OK) return rc;
    }
}

int rr_arena_round(rr_arena *a, rr_transport *t, const void *head, size_t hlen, const void *data, size_t dlen,
                   int *all_fit, rr_error *err)
{
    const uint64_t round = a->current + 1;
    unsigned char *mine = buffer(a, a->rank, round);
    const uint64_t len = hlen + dlen;
    memcpy(mine, &len, 8);
    if (len <= a->slot) { /* else the length alone says it did not fit */
        memcpy(mine + 8, head, hlen);
        if (dlen) memcpy(mine + 8 + hlen, data, dlen);
    }
    /* what every other rank of the host reads from us: the length word, and the blob if it fits */
    rr_count_sent(t, RR_SENT_BLOBS, RR_VIA_ARENA, 8 + (len <= a->slot ? len : 0));
    publish(a, round);
    a->current = round;
    *all_fit = 1;
    for (int k = 1; k <= a->size; k++) { /* ours last: it is there already */
        const int i = (a->rank + k) % a->size;
        int rc = wait_for(a, t, i, round, err);
        if (rc != RR_OK) return rc;
        size_t n;
        rr_arena_blob(a, i, &n);
        if (n > a->slot) *all_fit = 0;
        if (i != a->rank) rr_count_received(t, RR_VIA_ARENA, 8 + (n <= a->slot ? n : 0)); /* as its writer counted */
    }
    return RR_OK;
}

void rr_arena_offer_split(rr_arena *a, int split) { a->offer = split != 0; }

int rr_arena_all_split(const rr_arena *a)
{
    for (int i = 0; i < a->size; i++)
        if (!a->round[i].split[a->current & 1]) return 0;
    return 1;
}

/* The cost model (docs/performance.md, "The host arena, one at a time"):
 * per rank, DIRECT folds N-1 times S bytes, reading (N-1) S of lines other
 * cores wrote; SPLIT folds (N-1)/N S and reads 2(N-1)/N S of them (the
 * slices of the blobs, then the others' results), for one more round: one
 * more wait, which costs a wake-up whenever ranks share cores. At N = 2
 * the reads are the same and the saved fold (S/2) about pays for writing
 * and re-reading the result: DIRECT (measured with a core per rank: SPLIT
 * won isolated only from 48 to 64 KiB, and lost back to back there, 18.5
 * against 9.5 us at 64 KiB). From N = 3, with a core per rank, the saved
 * reads ((N-1)(1 - 2/N) S, ~5 ns a line) outweigh that second round's 8-9
 * us from about 128 KiB (not measured: no such machine here). */
#define SPLIT_MIN_BYTES ((size_t)128 << 10)

int rr_arena_wants_split(int mode, int size, size_t bytes)
{
    if (mode == RR_ARENA_SPLIT) return size > 1;
    if (mode != RR_ARENA_AUTO || size < 3 || bytes < SPLIT_MIN_BYTES) return 0;
    static long cores; /* a benign race: every thread computes the same */
    if (!cores) cores = sysconf(_SC_NPROCESSORS_ONLN);
    return size <= cores;
}

/* Measured with a core per rank at N = 2 (32-64 KiB: 8-13% faster; from
 * 96 KiB 5-8% slower: there the hardware's own prefetch does better alone). */
#define PREFETCH_MAX_BYTES ((size_t)64 << 10)
#define PREFETCH_CHUNK ((size_t)8 << 10)
#define MAX_FOLD_TERMS 64

int rr_arena_fold(void *out, const void *const *in, int n, int own, size_t count, rr_dtype dtype, rr_op op)
{
    const size_t esize = rr_dtype_size(dtype), bytes = count * esize;
    if (bytes <= PREFETCH_CHUNK || bytes > PREFETCH_MAX_BYTES || n > MAX_FOLD_TERMS)
        return rr_reduce_in_order(out, in, n, count, dtype, op);
    const void *at[MAX_FOLD_TERMS];
    for (size_t done = 0; done < bytes; done += PREFETCH_CHUNK) { /* esize divides the chunk */
        const size_t m = bytes - done < PREFETCH_CHUNK ? bytes - done : PREFETCH_CHUNK;
        const size_t next = bytes - done - m < PREFETCH_CHUNK ? bytes - done - m : PREFETCH_CHUNK;
        for (int i = 0; i < n; i++) {
            at[i] = (const char *)in[i] + done;
            if (i != own)
                for (size_t b = 0; b < next; b += LINE) __builtin_prefetch((const char *)at[i] + m + b, 0, 3);
        }
        int rc = rr_reduce_in_order((char *)out + done, at, n, m / esize, dtype, op);
        if (rc) return rc;
    }
    return 0;
}

static int overlaps(const void *p, const void *q, size_t n)
{
    const char *a = p, *b = q;
    return n && a < b + n && b < a + n;
}

int rr_arena_allreduce_split(rr_arena *a, rr_transport *t, size_t hlen, const void *data, size_t dlen, void *out,
                             rr_dtype dtype, rr_op op, rr_error *err)
{
    const int N = a->size, r = a->rank;
    const size_t esize = rr_dtype_size(dtype), count = dlen / esize;
    /* Slices of whole cache lines (of the data; the blob's header may skew
     * them against the mapping's lines), the last one shorter or empty. */
    const size_t per = round_up((count + (size_t)N - 1) / (size_t)N, LINE / esize);
#define LO(i) ((size_t)(i) * per < count ? (size_t)(i) * per : count)
#define HI(i) LO((i) + 1)
    const void **in = malloc(sizeof *in * (size_t)N);
    if (!in) { /* nothing published yet: every other rank waits and hears of it */
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return err->code;
    }
    const size_t lo = LO(r), n = HI(r) - lo;
    for (int i = 0; i < N; i++)
        in[i] = i == r && !overlaps(data, out, dlen) ? (const void *)((const char *)data + lo * esize)
                                                      : (const void *)(buffer(a, i, a->current) + 8 + hlen + lo * esize);
    const uint64_t round = a->current + 1, len = hlen + dlen;
    unsigned char *next = buffer(a, r, round);
    memcpy(next, &len, 8);
    const int bad = n ? rr_reduce_in_order(next + 8 + hlen + lo * esize, in, N, n, dtype, op) : 0;
    free(in);
    rr_count_sent(t, RR_SENT_BLOBS, RR_VIA_ARENA, 8 + n * esize); /* our reduced slice, for the others to copy */
    publish(a, round); /* even after a failed fold, so that nobody waits for us */
    a->current = round;
    if (bad) {
        rr_set_error(err, RR_E_INVALID, -1, "unsupported dtype %d or op %d", (int)dtype, (int)op);
        return err->code;
    }
    for (int k = 1; k <= N; k++) { /* ours last: it is there already */
        const int i = (r + k) % N;
        int rc = wait_for(a, t, i, round, err);
        if (rc != RR_OK) return rc;
        memcpy((char *)out + LO(i) * esize, buffer(a, i, round) + 8 + hlen + LO(i) * esize, (HI(i) - LO(i)) * esize);
        if (i != r) rr_count_received(t, RR_VIA_ARENA, 8 + (HI(i) - LO(i)) * esize); /* as its writer counted */
    }
#undef LO
#undef HI
    return RR_OK;
}
