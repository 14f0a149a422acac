/* An emulated device in host memory, for testing the ring's staged path
 * (device.h) on machines without a GPU.
 *
 * It is built to make mistakes visible, not to be fast:
 * - Device pointers are host addresses with a high bit set: the host faults
 *   on them, so any host access to device memory crashes the test.
 * - Queued work runs late: a ticket asked about is "not yet" until it has
 *   been asked `patience` times (0: never), and only then, or when waited
 *   for, does the work up to it run. So the ring always meets work in flight
 *   and must not send a mirror segment or reuse a slot before its ticket is
 *   done; with patience 0 work piles up as far as the ring lets it.
 * - IPC windows are memfd mappings (shared with the processes that open
 *   them through /proc/<pid>/fd/<fd>), tagged like all device memory; a
 *   peer's work on them also runs late, so the IPC path's handshakes must
 *   wait for each side's work before the other reads.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "device/device.h"
#include "kernels/reduce.h"

#define TAG ((uintptr_t)1 << 62)

static void *to_host_ptr(const void *dev) { return (void *)((uintptr_t)dev & ~TAG); }

enum { OP_TO_HOST, OP_TO_DEVICE, OP_COPY, OP_REDUCE3, OP_MEAN, OP_DIVIDE, OP_MARK };

typedef struct {
    int kind;
    void *dst;
    const void *a, *b;
    size_t n; /* bytes for copies, elements for kernels */
    rr_dtype dtype;
    rr_op op;
    int divisor; /* OP_DIVIDE: n; OP_MEAN: k */
} queued;

typedef struct {
    rr_device base;
    queued *q;
    size_t head, len, cap; /* q[head .. len) not yet run */
    uint64_t marked, finished;
    int patience, asked; /* asked: questions since work last ran */
    char identity[RR_IPC_IDENTITY]; /* empty: IPC refused */
} emulated;

static int begin(rr_device *d, rr_error *err) { (void)d; (void)err; return RR_OK; }

static int push(emulated *e, queued item, rr_error *err)
{
    if (e->len == e->cap) {
        if (e->head) { /* drop what has run */
            memmove(e->q, e->q + e->head, (e->len - e->head) * sizeof *e->q);
            e->len -= e->head;
            e->head = 0;
        } else {
            size_t cap = e->cap ? 2 * e->cap : 64;
            queued *q = realloc(e->q, cap * sizeof *q);
            if (!q) { rr_set_error(err, RR_E_SYSTEM, -1, "out of memory"); return err->code; }
            e->q = q;
            e->cap = cap;
        }
    }
    e->q[e->len++] = item;
    return RR_OK;
}

static int valid_device_ptr(const void *p) { return p == NULL || ((uintptr_t)p & TAG); }

static int check(int ok, rr_error *err, const char *what)
{
    if (ok) return RR_OK;
    rr_set_error(err, RR_E_DEVICE, -1, "emulated device: %s got a host pointer where device memory belongs", what);
    return err->code;
}

static int to_host(rr_device *d, void *host, const void *dev, size_t n, rr_error *err)
{
    if (check(valid_device_ptr(dev) && !((uintptr_t)host & TAG), err, "to_host")) return err->code;
    return push((emulated *)d, (queued){.kind = OP_TO_HOST, .dst = host, .a = dev, .n = n}, err);
}

static int to_device(rr_device *d, void *dev, const void *host, size_t n, rr_error *err)
{
    if (check(valid_device_ptr(dev) && !((uintptr_t)host & TAG), err, "to_device")) return err->code;
    return push((emulated *)d, (queued){.kind = OP_TO_DEVICE, .dst = dev, .a = host, .n = n}, err);
}

static int copy(rr_device *d, void *dst, const void *src, size_t n, rr_error *err)
{
    if (check(valid_device_ptr(dst) && valid_device_ptr(src), err, "copy")) return err->code;
    return push((emulated *)d, (queued){.kind = OP_COPY, .dst = dst, .a = src, .n = n}, err);
}

static int reduce3(rr_device *d, void *dst, const void *a, const void *b, size_t count, rr_dtype dtype,
                   rr_op op, rr_error *err)
{
    if (check(valid_device_ptr(dst) && valid_device_ptr(a) && valid_device_ptr(b), err, "reduce3"))
        return err->code;
    return push((emulated *)d,
                (queued){.kind = OP_REDUCE3, .dst = dst, .a = a, .b = b, .n = count, .dtype = dtype, .op = op}, err);
}

static int mean_fold(rr_device *d, void *dst, const void *x, const void *mean, size_t count, rr_dtype dtype,
                     int k, rr_error *err)
{
    if (check(valid_device_ptr(dst) && valid_device_ptr(x) && valid_device_ptr(mean), err, "mean_fold"))
        return err->code;
    return push((emulated *)d,
                (queued){.kind = OP_MEAN, .dst = dst, .a = x, .b = mean, .n = count, .dtype = dtype, .divisor = k},
                err);
}

static int divide(rr_device *d, void *buf, size_t count, rr_dtype dtype, int n, rr_error *err)
{
    if (check(valid_device_ptr(buf), err, "divide")) return err->code;
    return push((emulated *)d, (queued){.kind = OP_DIVIDE, .dst = buf, .n = count, .dtype = dtype, .divisor = n},
                err);
}

static uint64_t mark(rr_device *d, rr_error *err)
{
    emulated *e = (emulated *)d;
    if (push(e, (queued){.kind = OP_MARK}, err)) return 0;
    return ++e->marked;
}

/* Runs queued work up to and including the next mark. */
static void run_batch(emulated *e)
{
    while (e->head < e->len) {
        queued *w = &e->q[e->head++];
        switch (w->kind) {
        case OP_TO_HOST: memcpy(w->dst, to_host_ptr(w->a), w->n); break;
        case OP_TO_DEVICE: memcpy(to_host_ptr(w->dst), w->a, w->n); break;
        case OP_COPY: memmove(to_host_ptr(w->dst), to_host_ptr(w->a), w->n); break;
        case OP_REDUCE3:
            rr_reduce3(to_host_ptr(w->dst), to_host_ptr(w->a), to_host_ptr(w->b), w->n, w->dtype, w->op);
            break;
        case OP_MEAN:
            rr_mean_fold(to_host_ptr(w->dst), to_host_ptr(w->a), to_host_ptr(w->b), w->n, w->dtype, w->divisor);
            break;
        case OP_DIVIDE: rr_divide(to_host_ptr(w->dst), w->n, w->dtype, w->divisor); break;
        case OP_MARK: e->finished++; return;
        }
    }
}

static int done(rr_device *d, uint64_t ticket, int wait, rr_error *err)
{
    emulated *e = (emulated *)d;
    if (ticket > e->marked) {
        rr_set_error(err, RR_E_INVALID, -1, "emulated device: ticket %llu was never issued",
                     (unsigned long long)ticket);
        return -err->code;
    }
    if (e->finished >= ticket) return 1;
    if (!wait && (e->patience == 0 || ++e->asked < e->patience)) return 0;
    e->asked = 0;
    while (e->finished < ticket) run_batch(e);
    return 1;
}

static void *host_alloc(rr_device *d, size_t n) { (void)d; return malloc(n ? n : 1); }
static void host_free(rr_device *d, void *p) { (void)d; free(p); }

static void *dev_alloc(rr_device *d, size_t n)
{
    (void)d;
    void *p = malloc(n ? n : 1);
    return p ? (void *)((uintptr_t)p | TAG) : NULL;
}

static void dev_free(rr_device *d, void *p) { (void)d; free(p ? to_host_ptr(p) : NULL); }

static void destroy(rr_device *d)
{
    emulated *e = (emulated *)d;
    free(e->q);
    free(e);
}

static int ipc_identity(rr_device *d, char out[RR_IPC_IDENTITY], rr_error *err)
{
    emulated *e = (emulated *)d;
    if (!e->identity[0]) {
        rr_set_error(err, RR_E_DEVICE, -1, "emulated device: IPC refused (made so)");
        return err->code;
    }
    memcpy(out, e->identity, RR_IPC_IDENTITY);
    return RR_OK;
}

/* Emulated GPUs have no peer access: only its own identity. */
static int ipc_reaches(rr_device *d, const char *identity)
{
    emulated *e = (emulated *)d;
    return e->identity[0] && strcmp(identity, e->identity) == 0;
}

typedef struct { int32_t pid, fd; } emulated_handle;

static void *map_shared(int fd, size_t n)
{
    void *p = mmap(NULL, n ? n : 1, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : (void *)((uintptr_t)p | TAG);
}

static void *ipc_export(rr_device *d, size_t n, rr_ipc_handle *h, rr_error *err)
{
    (void)d;
    int fd = memfd_create("ringreduce-ipc-window", MFD_CLOEXEC);
    void *p = NULL;
    if (fd >= 0 && ftruncate(fd, (off_t)(n ? n : 1)) == 0) p = map_shared(fd, n);
    if (!p) {
        rr_set_error(err, RR_E_DEVICE, -1, "emulated device: no IPC window of %zu bytes", n);
        if (fd >= 0) close(fd);
        return NULL;
    }
    emulated_handle eh = {(int32_t)getpid(), fd};
    memcpy(h->data, &eh, sizeof eh);
    return p;
}

static void ipc_unexport(rr_device *d, void *p, const rr_ipc_handle *h)
{
    (void)d;
    emulated_handle eh;
    memcpy(&eh, h->data, sizeof eh);
    munmap(to_host_ptr(p), h->bytes ? h->bytes : 1);
    close(eh.fd);
}

static void *ipc_open(rr_device *d, const rr_ipc_handle *h, rr_error *err)
{
    (void)d;
    emulated_handle eh;
    memcpy(&eh, h->data, sizeof eh);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)eh.pid, (int)eh.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    void *p = fd >= 0 ? map_shared(fd, h->bytes) : NULL;
    if (fd >= 0) close(fd);
    if (!p) rr_set_error(err, RR_E_DEVICE, -1, "emulated device: cannot open IPC window %s", path);
    return p;
}

static void ipc_close(rr_device *d, void *p, const rr_ipc_handle *h)
{
    (void)d;
    munmap(to_host_ptr(p), h->bytes ? h->bytes : 1);
}

static const rr_device_ops emulated_ops = {
    begin, to_host, to_device, copy, reduce3, mean_fold, divide, mark, done, host_alloc, host_free, dev_alloc, dev_free, destroy,
    ipc_identity, ipc_reaches, ipc_export, ipc_unexport, ipc_open, ipc_close,
};

static rr_device *create(int patience, const char *identity)
{
    emulated *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->patience = patience;
    e->base.ops = &emulated_ops;
    snprintf(e->identity, sizeof e->identity, "%s", identity);
    return &e->base;
}

/* Every emulated device of a host is one "GPU": all open each other's windows. */
rr_device *rr_emulated_device_create(int patience) { return create(patience, "emulated"); }
rr_device *rr_emulated_device_create_as(int patience, const char *identity) { return create(patience, identity); }

/* For the binding's test helpers: emulated device memory seen from the host. */
void *rr_emulated_host_view(const void *dev) { return to_host_ptr(dev); }
