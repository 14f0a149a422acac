/* The CUDA device (device.h) through the CUDA driver API.
 *
 * libcuda is opened at run time, so ringreduce._core builds and imports
 * where there is no CUDA at all; the few driver types are declared here
 * for the same reason. The kernels are csrc/kernels/cuda/reduce.cu, loaded by the
 * Python side (ringreduce/cuda.py, through cupy) and handed over as
 * CUfunction handles. Work runs on one non-blocking stream of the device's
 * primary context, the context cupy uses; tickets are events recorded on it.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "device/device.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUfunc_st *CUfunction;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CU_STREAM_NON_BLOCKING 1
#define CU_EVENT_DISABLE_TIMING 2
#define CU_MEMHOSTREGISTER_PORTABLE 1
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1

#define DRIVER_FUNCTIONS(X)                                                                     \
    X(cuInit, (unsigned))                                                                       \
    X(cuGetErrorString, (CUresult, const char **))                                              \
    X(cuDeviceGet, (CUdevice *, int))                                                           \
    X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                                        \
    X(cuDevicePrimaryCtxRelease_v2, (CUdevice))                                                 \
    X(cuCtxSetCurrent, (CUcontext))                                                             \
    X(cuStreamCreate, (CUstream *, unsigned))                                                   \
    X(cuStreamDestroy_v2, (CUstream))                                                           \
    X(cuStreamSynchronize, (CUstream))                                                          \
    X(cuEventCreate, (CUevent *, unsigned))                                                     \
    X(cuEventDestroy_v2, (CUevent))                                                             \
    X(cuEventRecord, (CUevent, CUstream))                                                       \
    X(cuEventQuery, (CUevent))                                                                  \
    X(cuEventSynchronize, (CUevent))                                                            \
    X(cuMemcpyDtoHAsync_v2, (void *, CUdeviceptr, size_t, CUstream))                            \
    X(cuMemcpyHtoDAsync_v2, (CUdeviceptr, const void *, size_t, CUstream))                      \
    X(cuMemcpyDtoDAsync_v2, (CUdeviceptr, CUdeviceptr, size_t, CUstream))                       \
    X(cuMemHostRegister_v2, (void *, size_t, unsigned))                                         \
    X(cuMemHostUnregister, (void *))                                                            \
    X(cuMemAlloc_v2, (CUdeviceptr *, size_t))                                                   \
    X(cuMemFree_v2, (CUdeviceptr))                                                              \
    X(cuLaunchKernel, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, \
                       unsigned, CUstream, void **, void **))

/* The IPC path's (ipc.c), loaded where the driver has them: without them
 * the device refuses IPC and the staged path runs. Of the two UUID calls
 * one is enough: cuDeviceGetUuid_v2 (CUDA 11.4 on) where the driver has it,
 * else cuDeviceGetUuid (see device_uuid). */
#define IPC_FUNCTIONS(X)                                                    \
    X(cuDeviceGetUuid, (CUuuid *, CUdevice))                                \
    X(cuDeviceGetUuid_v2, (CUuuid *, CUdevice))                             \
    X(cuDeviceGetCount, (int *))                                            \
    X(cuDeviceCanAccessPeer, (int *, CUdevice, CUdevice))                   \
    X(cuIpcGetMemHandle, (CUipcMemHandle *, CUdeviceptr))                   \
    X(cuIpcOpenMemHandle_v2, (CUdeviceptr *, CUipcMemHandle, unsigned))     \
    X(cuIpcCloseMemHandle, (CUdeviceptr))

typedef struct {
#define FIELD(name, args) CUresult (*name) args;
    DRIVER_FUNCTIONS(FIELD)
    IPC_FUNCTIONS(FIELD)
#undef FIELD
} driver;

static driver cu;
static const char *cu_missing; /* why the driver could not be loaded, once tried */
static pthread_once_t cu_once = PTHREAD_ONCE_INIT; /* devices are made without the GIL: one thread loads */

static void load_once(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) cu_missing = "libcuda.so.1 not found (no NVIDIA driver)";
#define LOAD(name, args)                                                        \
    if (lib && !cu_missing && !(cu.name = (CUresult(*) args)dlsym(lib, #name))) \
        cu_missing = "libcuda.so.1 lacks " #name;
    DRIVER_FUNCTIONS(LOAD)
#undef LOAD
#define LOAD_IPC(name, args) if (lib) cu.name = (CUresult(*) args)dlsym(lib, #name);
    IPC_FUNCTIONS(LOAD_IPC)
#undef LOAD_IPC
    if (!cu_missing && cu.cuInit(0) != CUDA_SUCCESS) cu_missing = "cuInit failed (no usable GPU)";
}

static int load_driver(rr_error *err)
{
    pthread_once(&cu_once, load_once);
    if (cu_missing) rr_set_error(err, RR_E_DEVICE, -1, "CUDA: %s", cu_missing);
    return cu_missing ? RR_E_DEVICE : RR_OK;
}

#define EVENTS 32
#define THREADS 256

typedef struct {
    rr_device base;
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    CUevent event[EVENTS]; /* ticket t is event[(t - 1) % EVENTS] */
    uint64_t marked, finished;
    CUfunction reduce[RR_NUM_DTYPES][4], divide[RR_NUM_DTYPES], mean[RR_NUM_MEAN_DTYPES];
    pid_t pid; /* the process that made it: CUDA does not survive fork */
} cuda_device;

/* A child forked after the device was made holds the parent's handles, but
 * CUDA state does not cross fork and the pinned pages did not either
 * (host_alloc): such a child must never touch the driver, only let go. */
static int forked_away(const rr_device *d) { return ((const cuda_device *)d)->pid != getpid(); }

static int check(CUresult r, const char *what, rr_error *err)
{
    if (r == CUDA_SUCCESS) return RR_OK;
    const char *why = NULL;
    if (cu.cuGetErrorString(r, &why) != CUDA_SUCCESS || !why) why = "unknown error";
    rr_set_error(err, RR_E_DEVICE, -1, "CUDA: %s failed: %s (%d)", what, why, r);
    return err->code;
}

static int begin(rr_device *d, rr_error *err)
{
    if (forked_away(d)) {
        rr_set_error(err, RR_E_DEVICE, -1, "CUDA: this GPU device belongs to the process that forked this one "
                     "(CUDA does not survive fork): use the GPU only in processes that did not inherit it");
        return err->code;
    }
    return check(cu.cuCtxSetCurrent(((cuda_device *)d)->ctx), "cuCtxSetCurrent", err);
}

static int to_host(rr_device *d, void *host, const void *dev, size_t n, rr_error *err)
{
    return check(cu.cuMemcpyDtoHAsync_v2(host, (CUdeviceptr)dev, n, ((cuda_device *)d)->stream),
                 "cuMemcpyDtoHAsync", err);
}

static int to_device(rr_device *d, void *dev, const void *host, size_t n, rr_error *err)
{
    return check(cu.cuMemcpyHtoDAsync_v2((CUdeviceptr)dev, host, n, ((cuda_device *)d)->stream),
                 "cuMemcpyHtoDAsync", err);
}

static int copy(rr_device *d, void *dst, const void *src, size_t n, rr_error *err)
{
    return check(cu.cuMemcpyDtoDAsync_v2((CUdeviceptr)dst, (CUdeviceptr)src, n, ((cuda_device *)d)->stream),
                 "cuMemcpyDtoDAsync", err);
}

static unsigned blocks(size_t count)
{
    size_t b = (count + THREADS - 1) / THREADS;
    return b == 0 ? 1 : b > 65535 ? 65535 : (unsigned)b; /* the kernels loop over the rest */
}

static int reduce3(rr_device *d, void *dst, const void *a, const void *b, size_t count, rr_dtype dtype,
                   rr_op op, rr_error *err)
{
    cuda_device *c = (cuda_device *)d;
    CUfunction f = c->reduce[dtype][op == RR_AVG ? RR_SUM : op];
    CUdeviceptr pd = (CUdeviceptr)dst, pa = (CUdeviceptr)a, pb = (CUdeviceptr)b;
    void *args[] = {&pd, &pa, &pb, &count};
    return check(cu.cuLaunchKernel(f, blocks(count), 1, 1, THREADS, 1, 1, 0, c->stream, args, NULL),
                 "reduce kernel launch", err);
}

static int mean_fold(rr_device *d, void *dst, const void *x, const void *mean, size_t count, rr_dtype dtype,
                     int k, rr_error *err)
{
    cuda_device *c = (cuda_device *)d;
    if (!rr_avg_is_mean(dtype)) {
        rr_set_error(err, RR_E_INVALID, -1, "no running-mean kernel for dtype %d", (int)dtype);
        return err->code;
    }
    CUdeviceptr pd = (CUdeviceptr)dst, px = (CUdeviceptr)x, pm = (CUdeviceptr)mean;
    void *args[] = {&pd, &px, &pm, &count, &k};
    return check(cu.cuLaunchKernel(c->mean[dtype], blocks(count), 1, 1, THREADS, 1, 1, 0, c->stream, args, NULL),
                 "mean kernel launch", err);
}

static int divide(rr_device *d, void *buf, size_t count, rr_dtype dtype, int n, rr_error *err)
{
    cuda_device *c = (cuda_device *)d;
    CUdeviceptr p = (CUdeviceptr)buf;
    void *args[] = {&p, &count, &n};
    return check(cu.cuLaunchKernel(c->divide[dtype], blocks(count), 1, 1, THREADS, 1, 1, 0, c->stream, args, NULL),
                 "divide kernel launch", err);
}

static int done(rr_device *d, uint64_t ticket, int wait, rr_error *err)
{
    cuda_device *c = (cuda_device *)d;
    if (ticket <= c->finished) return 1;
    CUevent ev = c->event[(ticket - 1) % EVENTS];
    CUresult r = wait ? cu.cuEventSynchronize(ev) : cu.cuEventQuery(ev);
    if (r == CUDA_ERROR_NOT_READY) return 0;
    if (check(r, wait ? "cuEventSynchronize" : "cuEventQuery", err)) return -err->code;
    c->finished = ticket; /* one stream: everything before it has finished too */
    return 1;
}

static uint64_t mark(rr_device *d, rr_error *err)
{
    cuda_device *c = (cuda_device *)d;
    uint64_t t = c->marked + 1;
    /* Reusing an event: the ticket that had it must have finished. */
    if (t > EVENTS && done(d, t - EVENTS, 1, err) < 0) return 0;
    if (check(cu.cuEventRecord(c->event[(t - 1) % EVENTS], c->stream), "cuEventRecord", err)) return 0;
    return c->marked = t;
}

/* Pinned host memory that other processes can still read: plain anonymous
 * pages, registered with the driver. The ring's Cross Memory Attach path
 * reads a peer's mirror with process_vm_readv, which fails (EFAULT) on the
 * driver's own mappings that cuMemHostAlloc hands out. The registered pages
 * are not inherited by a fork: copy-on-write could otherwise move this
 * process's pages away from the ones the GPU copies to. A page in front,
 * inherited, keeps the mapping's length and whether it was registered, so a
 * forked child can still let go of the mapping (host_free). Where the driver
 * refuses to register them (some sandboxes do), the pages stay pageable:
 * CUDA's copies to and from them are slower but as correct, and the ring's
 * paths all still read them; the device counts them (counts.unpinned). */
typedef struct {
    size_t len;     /* the header page and the block */
    int registered; /* with cuMemHostRegister */
} host_block;

static void *host_alloc(rr_device *d, size_t n)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), len = page + (n ? n : 1);
    char *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    madvise(base + page, len - page, MADV_DONTFORK);
    host_block head = {len, cu.cuMemHostRegister_v2(base + page, len - page, CU_MEMHOSTREGISTER_PORTABLE) ==
                                CUDA_SUCCESS};
    if (!head.registered) d->counts.unpinned++;
    memcpy(base, &head, sizeof head);
    return base + page;
}

static void host_free(rr_device *d, void *p)
{
    if (!p) return;
    char *base = (char *)p - (size_t)sysconf(_SC_PAGESIZE);
    host_block head;
    memcpy(&head, base, sizeof head);
    if (head.registered && !forked_away(d)) cu.cuMemHostUnregister(p);
    munmap(base, head.len);
}

static void *dev_alloc(rr_device *d, size_t n)
{
    (void)d;
    CUdeviceptr p = 0;
    return cu.cuMemAlloc_v2(&p, n ? n : 1) == CUDA_SUCCESS ? (void *)p : NULL;
}

static void dev_free(rr_device *d, void *p) { if (p && !forked_away(d)) cu.cuMemFree_v2((CUdeviceptr)p); }

static void destroy(rr_device *d)
{
    cuda_device *c = (cuda_device *)d;
    if (c->ctx && !forked_away(d)) {
        cu.cuCtxSetCurrent(c->ctx);
        for (int i = 0; i < EVENTS; i++) if (c->event[i]) cu.cuEventDestroy_v2(c->event[i]);
        if (c->stream) cu.cuStreamDestroy_v2(c->stream);
        cu.cuDevicePrimaryCtxRelease_v2(c->dev);
    }
    free(c);
}

static int ipc_loaded(rr_error *err)
{
    if ((cu.cuDeviceGetUuid_v2 || cu.cuDeviceGetUuid) && cu.cuDeviceGetCount && cu.cuDeviceCanAccessPeer &&
        cu.cuIpcGetMemHandle && cu.cuIpcOpenMemHandle_v2 && cu.cuIpcCloseMemHandle)
        return RR_OK;
    rr_set_error(err, RR_E_DEVICE, -1, "CUDA: the driver has no IPC (cuIpc*)");
    return err->code;
}

static void uuid_text(const CUuuid *id, char out[RR_IPC_IDENTITY])
{
    int at = snprintf(out, RR_IPC_IDENTITY, "cuda:");
    for (int i = 0; i < 16; i++) at += snprintf(out + at, RR_IPC_IDENTITY - (size_t)at, "%02x", (unsigned char)id->bytes[i]);
}

/* The device's UUID as IPC identity: cuDeviceGetUuid_v2's, which names each
 * MIG instance apart, where the driver has it; else cuDeviceGetUuid's, which
 * gives every MIG instance the whole GPU's UUID (drivers before CUDA 11.4:
 * there ranks on two MIG instances look alike, and the agreement's opens
 * of each other's windows decide). Every rank and every peer lookup
 * (ipc_reaches) takes the same one, so with _v2 ranks on two MIG instances
 * of one GPU never take each other for one device. */
static CUresult device_uuid(CUuuid *id, CUdevice dev)
{
    return cu.cuDeviceGetUuid_v2 ? cu.cuDeviceGetUuid_v2(id, dev) : cu.cuDeviceGetUuid(id, dev);
}

/* The device's UUID: ranks on one device open each other's memory. */
static int ipc_identity(rr_device *d, char out[RR_IPC_IDENTITY], rr_error *err)
{
    CUuuid id;
    if (ipc_loaded(err) || check(device_uuid(&id, ((cuda_device *)d)->dev),
                                 cu.cuDeviceGetUuid_v2 ? "cuDeviceGetUuid_v2" : "cuDeviceGetUuid", err))
        return err->code;
    uuid_text(&id, out);
    return RR_OK;
}

/* Its own GPU, or a GPU visible here (by UUID) that it has peer access to. */
static int ipc_reaches(rr_device *d, const char *identity)
{
    cuda_device *c = (cuda_device *)d;
    rr_error ignored;
    int n = 0;
    if (ipc_loaded(&ignored) || cu.cuDeviceGetCount(&n) != CUDA_SUCCESS) return 0;
    for (int i = 0; i < n; i++) {
        CUuuid id;
        char text[RR_IPC_IDENTITY];
        CUdevice other;
        int can = 0;
        if (cu.cuDeviceGet(&other, i) != CUDA_SUCCESS || device_uuid(&id, other) != CUDA_SUCCESS) continue;
        uuid_text(&id, text);
        if (strcmp(text, identity)) continue;
        if (other == c->dev) return 1;
        return cu.cuDeviceCanAccessPeer(&can, c->dev, other) == CUDA_SUCCESS && can;
    }
    return 0; /* not visible here (CUDA_VISIBLE_DEVICES): no peer access known */
}

static void *ipc_export(rr_device *d, size_t n, rr_ipc_handle *h, rr_error *err)
{
    (void)d;
    CUdeviceptr p = 0;
    CUipcMemHandle mh;
    if (ipc_loaded(err) || check(cu.cuMemAlloc_v2(&p, n ? n : 1), "cuMemAlloc (IPC window)", err)) return NULL;
    if (check(cu.cuIpcGetMemHandle(&mh, p), "cuIpcGetMemHandle", err)) {
        cu.cuMemFree_v2(p);
        return NULL;
    }
    memcpy(h->data, &mh, sizeof mh);
    return (void *)p;
}

static void ipc_unexport(rr_device *d, void *p, const rr_ipc_handle *h)
{
    (void)d;
    (void)h;
    cu.cuMemFree_v2((CUdeviceptr)p);
}

static void *ipc_open(rr_device *d, const rr_ipc_handle *h, rr_error *err)
{
    (void)d;
    CUdeviceptr p = 0;
    CUipcMemHandle mh;
    memcpy(&mh, h->data, sizeof mh);
    if (ipc_loaded(err) ||
        check(cu.cuIpcOpenMemHandle_v2(&p, mh, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle", err))
        return NULL;
    return (void *)p;
}

static void ipc_close(rr_device *d, void *p, const rr_ipc_handle *h)
{
    (void)d;
    (void)h;
    cu.cuIpcCloseMemHandle((CUdeviceptr)p);
}

static const rr_device_ops cuda_ops = {
    begin, to_host, to_device, copy, reduce3, mean_fold, divide, mark, done, host_alloc, host_free, dev_alloc, dev_free, destroy,
    ipc_identity, ipc_reaches, ipc_export, ipc_unexport, ipc_open, ipc_close,
};

rr_device *rr_cuda_device_create(int ordinal, void *const reduce[RR_NUM_DTYPES][4],
                                 void *const divide_fn[RR_NUM_DTYPES], void *const mean_fn[RR_NUM_MEAN_DTYPES],
                                 rr_error *err)
{
    if (load_driver(err)) return NULL;
    cuda_device *c = calloc(1, sizeof *c);
    if (!c) { rr_set_error(err, RR_E_SYSTEM, -1, "out of memory"); return NULL; }
    c->base.ops = &cuda_ops;
    c->pid = getpid();
    for (int t = 0; t < RR_NUM_DTYPES; t++) {
        c->divide[t] = divide_fn[t];
        for (int o = 0; o < 4; o++) c->reduce[t][o] = reduce[t][o];
    }
    for (int t = 0; t < RR_NUM_MEAN_DTYPES; t++) c->mean[t] = mean_fn[t];
    if (check(cu.cuDeviceGet(&c->dev, ordinal), "cuDeviceGet", err)) goto fail;
    if (check(cu.cuDevicePrimaryCtxRetain(&c->ctx, c->dev), "cuDevicePrimaryCtxRetain", err)) goto fail;
    if (begin(&c->base, err)) goto fail;
    if (check(cu.cuStreamCreate(&c->stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate", err)) goto fail;
    for (int i = 0; i < EVENTS; i++)
        if (check(cu.cuEventCreate(&c->event[i], CU_EVENT_DISABLE_TIMING), "cuEventCreate", err)) goto fail;
    return &c->base;
fail:
    destroy(&c->base);
    return NULL;
}
