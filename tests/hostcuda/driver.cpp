/* A CUDA driver (libcuda.so.1) over host memory, so that the code written
 * for a GPU runs, and is checked, on machines without one: csrc/device/cuda_device.c
 * through the driver API it opens at run time, and the kernels of
 * csrc/kernels/cuda/reduce.cu compiled for the host (cuda_builtins.h). The tests
 * build it (tests/hostcuda.py) and put its folder on LD_LIBRARY_PATH.
 *
 * Strict where CUDA is strict, and stricter where a mistake would show only
 * on a GPU, as wrong bits or lost speed:
 * - A call that needs a context fails with CUDA_ERROR_INVALID_CONTEXT unless
 *   the calling thread has made a retained primary context current.
 * - Device addresses must lie, with the whole range a copy or kernel
 *   touches, in one live cuMemAlloc block; host addresses must lie outside
 *   every block. A bad copy fails at once (CUDA_ERROR_INVALID_VALUE); a bad
 *   kernel argument fails at the next synchronization with
 *   CUDA_ERROR_ILLEGAL_ADDRESS, and every call after it fails too, as a
 *   faulted context does.
 * - Queued work runs late: an event is not ready until it has been queried
 *   HOSTCUDA_PATIENCE times (default 2; 0: only when synchronized), and only
 *   then does its stream run up to it. Kernel arguments are copied at launch.
 * - An async copy from or to pageable memory (neither cuMemHostAlloc'ed nor
 *   cuMemHostRegister'ed) runs at once, as CUDA runs it, and is counted:
 *   staging must be pinned to overlap.
 * - cuMemAlloc'ed memory is a memfd mapping, so cuIpcGetMemHandle can hand
 *   it to another process, which maps it with cuIpcOpenMemHandle (through
 *   /proc/<pid>/fd: one host, as CUDA IPC is); the opened range is device
 *   memory there for the rules above. HOSTCUDA_IPC=0 (read at each call)
 *   makes cuIpcGetMemHandle refuse (CUDA_ERROR_NOT_SUPPORTED),
 *   HOSTCUDA_IPC_OPEN=0 cuIpcOpenMemHandle (CUDA_ERROR_NOT_SUPPORTED: IPC not
 *   permitted, as in a container without the peer's processes), and
 *   HOSTCUDA_UUID_SALT changes cuDeviceGetUuid's answer: another "GPU".
 *   HOSTCUDA_HOST_REGISTER=0 (read at each call) makes cuMemHostRegister
 *   refuse (CUDA_ERROR_NOT_SUPPORTED), as sandboxed drivers may.
 *   Devices (HOSTCUDA_DEVICES) have peer access to each other unless
 *   HOSTCUDA_PEER_ACCESS=0.
 * - MIG: HOSTCUDA_MIG=k (k >= 1; read at each call) makes this process's
 *   devices MIG instances of one GPU, device d being instance k + d (so
 *   processes given other k sit on other instances, as CUDA_VISIBLE_DEVICES
 *   set to MIG UUIDs does). As on a GPU in MIG mode, cuDeviceGetUuid_v2
 *   gives each instance its own UUID while cuDeviceGetUuid gives every
 *   instance the GPU's, no instance has peer access to another, and
 *   cuIpcOpenMemHandle refuses (CUDA_ERROR_NOT_SUPPORTED) memory of
 *   another instance (IPC across GPU instances is not supported).
 *   Built with -DHOSTCUDA_NO_UUID_V2 it lacks cuDeviceGetUuid_v2, as
 *   drivers before CUDA 11.4 do.
 * - Modules: the device has compute capability HOSTCUDA_ARCH (default 90:
 *   9.0; cuDeviceGetAttribute says so). A module image (cuModuleLoadData,
 *   cuModuleLoad) is text, "hostcuda-module" and the code it holds: sm_XY
 *   (a cubin, which loads on compute capability X.Y alone) and compute_XY
 *   (PTX, which loads on X.Y and newer). An image with nothing for this
 *   device fails with CUDA_ERROR_NO_BINARY_FOR_GPU, as a fatbin built for
 *   another GPU does. Its kernels are reduce.cu's (cuModuleGetFunction).
 * - Flags are checked as cuda.h documents them: cuInit takes 0,
 *   cuStreamCreate CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING,
 *   cuEventCreate CU_EVENT_{BLOCKING_SYNC,DISABLE_TIMING,INTERPROCESS}
 *   (INTERPROCESS only with DISABLE_TIMING), cuMemHostAlloc and
 *   cuMemHostRegister their CU_MEMHOST* bits, and cuIpcOpenMemHandle
 *   exactly CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS; anything else is
 *   CUDA_ERROR_INVALID_VALUE.
 * - hostcuda_stats() counts what is alive, so tests catch leaks, and the
 *   cuMemFree's of memory another process still has open by IPC (a use
 *   after free waiting to happen on a GPU): each open holds a shared flock
 *   on the memfd until it is closed, which the exporter's cuMemFree tests.
 * Every entry point takes one lock: work runs in the order it was queued.
 */
#include "cuda_builtins.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>

struct CUfunc_st;

thread_local uint3 threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_FILE_NOT_FOUND = 301,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;

/* cuda.h's flags */
enum : unsigned {
    CU_STREAM_NON_BLOCKING = 0x1,
    CU_EVENT_BLOCKING_SYNC = 0x1,
    CU_EVENT_DISABLE_TIMING = 0x2,
    CU_EVENT_INTERPROCESS = 0x4,
    CU_MEMHOSTALLOC_PORTABLE = 0x1,
    CU_MEMHOSTALLOC_DEVICEMAP = 0x2,
    CU_MEMHOSTALLOC_WRITECOMBINED = 0x4,
    CU_MEMHOSTREGISTER_PORTABLE = 0x1,
    CU_MEMHOSTREGISTER_DEVICEMAP = 0x2,
    CU_MEMHOSTREGISTER_IOMEMORY = 0x4,
    CU_MEMHOSTREGISTER_READ_ONLY = 0x8,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1,
};

namespace {

enum Kind { REDUCE, MEAN, DIVIDE, CAST };

struct Work {
    bool launch;
    /* A copy: n bytes from src to dst. */
    void *dst;
    const void *src;
    size_t n;
    /* A launch: the kernel, its grid and its arguments, copied. */
    CUfunc_st *f;
    unsigned grid, block;
    void *p[3];
    size_t count;
    int divisor; /* DIVIDE: n; MEAN: k */
};

} // namespace

struct CUctx_st {
    int retained;
};
struct CUstream_st {
    std::deque<Work> queue;
    uint64_t queued = 0, ran = 0;
    int asked = 0; /* queries since work last ran */
};
struct CUevent_st {
    CUstream_st *stream = nullptr;
    uint64_t at = 0; /* the stream's work up to here */
};
struct CUmod_st {
    int arch; /* the code it loaded: sm_<arch> or compute_<arch> */
};
struct CUfunc_st {
    Kind kind;
    size_t dst_size, src_size; /* element sizes */
    void *fn;
};

typedef CUctx_st *CUcontext;
typedef CUstream_st *CUstream;
typedef CUevent_st *CUevent;
typedef CUfunc_st *CUfunction;
typedef CUmod_st *CUmodule;

namespace {

const int MAX_DEVICES = 8;

struct Block {
    size_t n;
    bool api;          /* from cuMemAlloc, not hostcuda_alloc */
    int fd = -1;       /* cuMemAlloc's: the memfd it maps, for IPC; an opened one's: its own descriptor of the
                        * exporter's memfd, holding a shared flock while open (see ipc_freed_while_open) */
    bool opened = false; /* another process's, mapped by cuIpcOpenMemHandle */
};

/* What cuIpcGetMemHandle puts in a CUipcMemHandle. */
struct IpcHandle {
    uint32_t magic;
    int32_t pid, fd;
    int32_t instance; /* the exporting device's MIG instance (mig_instance) */
    uint64_t n;
};
const uint32_t IPC_MAGIC = 0x48434950; /* "HCIP" */

size_t mapped_size(size_t n)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

std::recursive_mutex mu;
bool initialized;
int devices = 1, patience = 2;
CUctx_st contexts[MAX_DEVICES];
thread_local CUctx_st *current;
CUresult sticky; /* a faulted context fails every call after */
CUstream_st default_stream;
std::map<uintptr_t, Block> device_blocks;
std::map<uintptr_t, size_t> pinned_blocks; /* cuMemHostAlloc'ed and registered */
std::set<uintptr_t> registered;             /* of those, cuMemHostRegister'ed */
std::set<CUstream_st *> streams;
std::set<CUevent_st *> events;
std::set<CUmod_st *> modules;
std::map<std::string, CUfunc_st> functions;
long long pageable_copies, launches, ipc_open_calls;
long long freed_while_open; /* cuMemFree of memory another process had open by IPC */

int env_int(const char *name, int fallback)
{
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

/* The block of `blocks` holding [p, p+n), if one does (n == 0: p inside or at its end). */
template <class M> bool holds(const M &blocks, const void *p, size_t n)
{
    auto a = (uintptr_t)p;
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return false;
    --it;
    size_t size;
    if constexpr (std::is_same_v<typename M::mapped_type, Block>) size = it->second.n;
    else size = it->second;
    return a >= it->first && a - it->first <= size && n <= size - (a - it->first);
}

bool touches_device(const void *p, size_t n)
{
    auto a = (uintptr_t)p;
    auto it = device_blocks.lower_bound(a + n); /* first block starting at or after the end */
    if (it == device_blocks.begin()) return false;
    --it;
    return it->first + it->second.n > a;
}

/* Device d's MIG instance under HOSTCUDA_MIG (0: a whole GPU). */
int mig_instance(CUdevice d)
{
    int k = env_int("HOSTCUDA_MIG", 0);
    return k > 0 ? k + d : 0;
}

/* The device whose context is current (after need_context()). */
CUdevice current_device() { return (CUdevice)(current - contexts); }

CUresult need_context()
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current || current->retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
    return sticky;
}

CUstream_st *stream_of(CUstream s) { return s ? s : &default_stream; }

bool launch_is_legal(const Work &w)
{
    const CUfunc_st &f = *w.f;
    switch (f.kind) {
    case REDUCE: case MEAN:
        return holds(device_blocks, w.p[0], w.count * f.dst_size) && holds(device_blocks, w.p[1], w.count * f.src_size) &&
               holds(device_blocks, w.p[2], w.count * f.src_size);
    case DIVIDE: return holds(device_blocks, w.p[0], w.count * f.dst_size);
    case CAST:
        return holds(device_blocks, w.p[0], w.count * f.dst_size) && holds(device_blocks, w.p[1], w.count * f.src_size);
    }
    return false;
}

void run_launch(const Work &w)
{
    gridDim = {w.grid, 1, 1};
    blockDim = {w.block, 1, 1};
    for (unsigned b = 0; b < w.grid; b++) {
        for (unsigned t = 0; t < w.block; t++) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            switch (w.f->kind) {
            case REDUCE: ((void (*)(void *, const void *, const void *, size_t))w.f->fn)(w.p[0], w.p[1], w.p[2], w.count); break;
            case MEAN:
                ((void (*)(void *, const void *, const void *, size_t, int))w.f->fn)(w.p[0], w.p[1], w.p[2], w.count,
                                                                                     w.divisor);
                break;
            case DIVIDE: ((void (*)(void *, size_t, int))w.f->fn)(w.p[0], w.count, w.divisor); break;
            case CAST: ((void (*)(void *, const void *, size_t))w.f->fn)(w.p[0], w.p[1], w.count); break;
            }
        }
    }
}

void run_until(CUstream_st *s, uint64_t upto)
{
    while (s->ran < upto) {
        Work w = s->queue.front();
        s->queue.pop_front();
        s->ran++;
        if (sticky) continue; /* a faulted context runs nothing more */
        if (!w.launch) memcpy(w.dst, w.src, w.n);
        else if (!launch_is_legal(w)) sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
        else run_launch(w);
    }
    s->asked = 0;
}

CUresult enqueue(CUstream s, const Work &w)
{
    CUstream_st *st = stream_of(s);
    st->queue.push_back(w);
    st->queued++;
    return CUDA_SUCCESS;
}

/* Host memory a copy reads or writes: pinned copies queue, pageable ones run now. */
CUresult host_copy(CUstream s, void *dst, const void *src, size_t n, const void *host)
{
    if (holds(pinned_blocks, host, n)) return enqueue(s, Work{false, dst, src, n, nullptr, 0, 0, {}, 0, 0});
    pageable_copies++;
    CUstream_st *st = stream_of(s);
    run_until(st, st->queued);
    if (sticky) return sticky;
    memcpy(dst, src, n);
    return CUDA_SUCCESS;
}

size_t dtype_size(const std::string &name)
{
    static const std::map<std::string, size_t> sizes = {
        {"float16", 2}, {"bfloat16", 2}, {"float32", 4}, {"float64", 8},
        {"int8", 1},    {"uint8", 1},    {"int32", 4},   {"int64", 8},
        {"int16", 2},   {"uint16", 2},
    };
    auto it = sizes.find(name);
    return it == sizes.end() ? 0 : it->second;
}

/* The kernel's signature from its name (csrc/kernels/cuda/reduce.cu's convention). */
bool describe(const std::string &name, CUfunc_st *f)
{
    auto starts = [&](const char *p) { return name.compare(0, strlen(p), p) == 0; };
    if (starts("rr_reduce_")) {
        size_t last = name.rfind('_');
        f->kind = REDUCE;
        f->dst_size = f->src_size = dtype_size(name.substr(10, last - 10));
    } else if (starts("rr_mean_")) {
        f->kind = MEAN;
        f->dst_size = f->src_size = dtype_size(name.substr(8)) == 2 ? 2 : 0; /* 16-bit floats only */
    } else if (starts("rr_divide_")) {
        f->kind = DIVIDE;
        f->dst_size = f->src_size = dtype_size(name.substr(10));
    } else if (starts("rr_cast_")) {
        size_t to = name.find("_to_");
        if (to == std::string::npos) return false;
        f->kind = CAST;
        f->src_size = dtype_size(name.substr(8, to - 8));
        f->dst_size = dtype_size(name.substr(to + 4));
    } else {
        return false;
    }
    return f->dst_size && f->src_size;
}

} // namespace

extern "C" {

CUresult cuInit(unsigned flags)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    devices = env_int("HOSTCUDA_DEVICES", 1);
    patience = env_int("HOSTCUDA_PATIENCE", 2);
    if (devices < 1) return CUDA_ERROR_NO_DEVICE;
    if (devices > MAX_DEVICES) devices = MAX_DEVICES;
    initialized = true;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult r, const char **s)
{
    static const std::map<CUresult, const char *> text = {
        {CUDA_SUCCESS, "no error"},
        {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
        {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
        {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
        {CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"},
        {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
        {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
        {CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"},
        {CUDA_ERROR_NO_BINARY_FOR_GPU, "no kernel image is available for execution on the device"},
        {CUDA_ERROR_FILE_NOT_FOUND, "file not found"},
        {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
        {CUDA_ERROR_NOT_FOUND, "named symbol not found"},
        {CUDA_ERROR_NOT_READY, "device not ready"},
        {CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"},
        {CUDA_ERROR_NOT_SUPPORTED, "operation not supported"},
    };
    auto it = text.find(r);
    *s = it == text.end() ? nullptr : it->second;
    return it == text.end() ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= devices) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= devices) return CUDA_ERROR_INVALID_DEVICE;
    contexts[d].retained++;
    *c = &contexts[d];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= devices) return CUDA_ERROR_INVALID_DEVICE;
    if (contexts[d].retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
    contexts[d].retained--;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext c)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (c && (c < contexts || c >= contexts + devices)) return CUDA_ERROR_INVALID_CONTEXT;
    current = c;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (flags & ~CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;
    *s = new CUstream_st;
    streams.insert(*s);
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream s)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!streams.erase(s)) return CUDA_ERROR_INVALID_HANDLE;
    run_until(s, s->queued); /* CUDA lets queued work finish first */
    delete s;
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream s)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (s && !streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
    run_until(stream_of(s), stream_of(s)->queued);
    return sticky;
}

CUresult cuEventCreate(CUevent *e, unsigned flags)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (flags & ~(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS) ||
        ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING)))
        return CUDA_ERROR_INVALID_VALUE;
    *e = new CUevent_st;
    events.insert(*e);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent e)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!events.erase(e)) return CUDA_ERROR_INVALID_HANDLE;
    delete e;
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream s)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!events.count(e) || (s && !streams.count(s))) return CUDA_ERROR_INVALID_HANDLE;
    e->stream = stream_of(s);
    e->at = e->stream->queued;
    return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent e)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    CUstream_st *s = e->stream;
    if (!s || s->ran >= e->at) return CUDA_SUCCESS;
    if (patience == 0 || ++s->asked < patience) return CUDA_ERROR_NOT_READY;
    run_until(s, e->at);
    return sticky;
}

CUresult cuEventSynchronize(CUevent e)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    if (e->stream) run_until(e->stream, e->at);
    return sticky;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (n == 0) return CUDA_SUCCESS;
    if (!holds(device_blocks, (void *)src, n) || touches_device(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    return host_copy(s, dst, (void *)src, n, dst);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (n == 0) return CUDA_SUCCESS;
    if (!holds(device_blocks, (void *)dst, n) || touches_device(src, n)) return CUDA_ERROR_INVALID_VALUE;
    return host_copy(s, (void *)dst, src, n, src);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (n == 0) return CUDA_SUCCESS;
    if (!holds(device_blocks, (void *)dst, n) || !holds(device_blocks, (void *)src, n)) return CUDA_ERROR_INVALID_VALUE;
    return enqueue(s, Work{false, (void *)dst, (void *)src, n, nullptr, 0, 0, {}, 0, 0});
}

CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (n == 0 || flags & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED))
        return CUDA_ERROR_INVALID_VALUE;
    if (!(*p = aligned_alloc(64, (n + 63) / 64 * 64))) return CUDA_ERROR_OUT_OF_MEMORY;
    pinned_blocks[(uintptr_t)*p] = n;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (registered.count((uintptr_t)p) || !pinned_blocks.erase((uintptr_t)p)) return CUDA_ERROR_INVALID_VALUE;
    free(p);
    return CUDA_SUCCESS;
}

/* Page-locks the caller's memory: here it only becomes pinned for the
 * rules above (no pageable copies). CUDA wants it page aligned. */
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (flags & ~(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                  CU_MEMHOSTREGISTER_READ_ONLY))
        return CUDA_ERROR_INVALID_VALUE;
    if (env_int("HOSTCUDA_HOST_REGISTER", 1) == 0) return CUDA_ERROR_NOT_SUPPORTED; /* some sandboxes refuse */
    if (n == 0 || (uintptr_t)p % 4096 || pinned_blocks.count((uintptr_t)p) || touches_device(p, n))
        return CUDA_ERROR_INVALID_VALUE;
    pinned_blocks[(uintptr_t)p] = n;
    registered.insert((uintptr_t)p);
    return CUDA_SUCCESS;
}

CUresult cuMemHostUnregister(void *p)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!registered.erase((uintptr_t)p)) return CUDA_ERROR_INVALID_VALUE;
    pinned_blocks.erase((uintptr_t)p);
    return CUDA_SUCCESS;
}

static CUresult device_alloc(CUdeviceptr *dp, size_t n, bool api)
{
    if (n == 0) return CUDA_ERROR_INVALID_VALUE;
    void *p;
    int fd = -1;
    if (api) { /* page aligned, so also 256 as cuMemAlloc's */
        fd = memfd_create("hostcuda-device", MFD_CLOEXEC);
        p = fd >= 0 && ftruncate(fd, (off_t)mapped_size(n)) == 0
                ? mmap(nullptr, mapped_size(n), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
        if (p == MAP_FAILED) {
            if (fd >= 0) close(fd);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (!(p = aligned_alloc(256, (n + 255) / 256 * 256))) { /* cuMemAlloc aligns to 256 bytes */
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(p, 0xcd, n); /* device memory starts as garbage, not zeros */
    Block b{n, api};
    b.fd = fd;
    device_blocks[(uintptr_t)p] = b;
    *dp = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

static void release(uintptr_t p, const Block &b)
{
    if (b.fd >= 0 || b.opened) munmap((void *)p, mapped_size(b.n));
    else free((void *)p);
    if (b.fd >= 0) close(b.fd);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dp, size_t n)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    return device_alloc(dp, n, true);
}

CUresult cuMemFree_v2(CUdeviceptr dp)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    auto it = device_blocks.find((uintptr_t)dp);
    if (it == device_blocks.end() || !it->second.api) return CUDA_ERROR_INVALID_VALUE;
    /* On a GPU, memory freed while another process has it open is a use
     * after free there: counted, for tests to hold at 0. */
    if (flock(it->second.fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) freed_while_open++;
    release(it->first, it->second);
    device_blocks.erase(it);
    return CUDA_SUCCESS;
}

/* A GPU's UUID names its device and HOSTCUDA_UUID_SALT; under MIG the GPU
 * is device 0's, and an instance's UUID (instance > 0) names the instance. */
static void make_uuid(CUuuid *uuid, int32_t device, int32_t instance)
{
    int32_t salt = env_int("HOSTCUDA_UUID_SALT", 0);
    memcpy(uuid->bytes, instance ? "hostcMIG" : "hostcuda", 8);
    memcpy(uuid->bytes + 8, instance ? &instance : &device, 4);
    memcpy(uuid->bytes + 12, &salt, 4);
}

/* The GPU's UUID: under MIG every instance's is the whole GPU's. */
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice d)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= devices) return CUDA_ERROR_INVALID_DEVICE;
    make_uuid(uuid, mig_instance(d) ? 0 : d, 0);
    return CUDA_SUCCESS;
}

#ifndef HOSTCUDA_NO_UUID_V2
/* The device's UUID: under MIG the instance's own. */
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice d)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= devices) return CUDA_ERROR_INVALID_DEVICE;
    make_uuid(uuid, d, mig_instance(d));
    return CUDA_SUCCESS;
}
#endif

CUresult cuDeviceGetCount(int *n)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *n = devices;
    return CUDA_SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= devices || peer < 0 || peer >= devices) return CUDA_ERROR_INVALID_DEVICE;
    *can = d != peer && env_int("HOSTCUDA_PEER_ACCESS", 1) != 0 && !mig_instance(d) && !mig_instance(peer);
    return CUDA_SUCCESS;
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr dp)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (env_int("HOSTCUDA_IPC", 1) == 0) return CUDA_ERROR_NOT_SUPPORTED;
    auto it = device_blocks.find((uintptr_t)dp);
    if (it == device_blocks.end() || !it->second.api) return CUDA_ERROR_INVALID_VALUE; /* a cuMemAlloc base only */
    IpcHandle ih{IPC_MAGIC, (int32_t)getpid(), it->second.fd, mig_instance(current_device()), it->second.n};
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &ih, sizeof ih);
    return CUDA_SUCCESS;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dp, CUipcMemHandle h, unsigned flags)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    ipc_open_calls++;
    IpcHandle ih;
    memcpy(&ih, h.reserved, sizeof ih);
    if (ih.magic != IPC_MAGIC || flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS || ih.n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (env_int("HOSTCUDA_IPC_OPEN", 1) == 0) return CUDA_ERROR_NOT_SUPPORTED;
    if (ih.instance != mig_instance(current_device())) return CUDA_ERROR_NOT_SUPPORTED; /* across MIG instances */
    if (ih.pid == (int32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* CUDA opens no handle of its own process */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)ih.pid, (int)ih.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
    void *p = mmap(nullptr, mapped_size(ih.n), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    flock(fd, LOCK_SH); /* open here until cuIpcCloseMemHandle (or this process ends) closes fd */
    Block b{ih.n, false};
    b.fd = fd;
    b.opened = true;
    device_blocks[(uintptr_t)p] = b;
    *dp = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dp)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    auto it = device_blocks.find((uintptr_t)dp);
    if (it == device_blocks.end() || !it->second.opened) return CUDA_ERROR_INVALID_VALUE;
    release(it->first, it->second);
    device_blocks.erase(it);
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared_bytes, CUstream s, void **params, void **extra)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    bool known = false;
    for (auto &kv : functions) known = known || &kv.second == f;
    if (!known) return CUDA_ERROR_INVALID_HANDLE;
    /* reduce.cu's kernels use x alone, no shared memory, and take kernelParams. */
    if (gx < 1 || gx > 0x7fffffffu || gy != 1 || gz != 1 || bx < 1 || bx > 1024 || by != 1 || bz != 1 ||
        shared_bytes != 0 || !params || extra)
        return CUDA_ERROR_INVALID_VALUE;
    Work w{true, nullptr, nullptr, 0, f, gx, bx, {}, 0, 0};
    auto ptr = [&](int i) { return (void *)*(CUdeviceptr *)params[i]; };
    switch (f->kind) {
    case REDUCE: w.p[0] = ptr(0); w.p[1] = ptr(1); w.p[2] = ptr(2); w.count = *(size_t *)params[3]; break;
    case MEAN:
        w.p[0] = ptr(0); w.p[1] = ptr(1); w.p[2] = ptr(2); w.count = *(size_t *)params[3]; w.divisor = *(int *)params[4];
        break;
    case DIVIDE: w.p[0] = ptr(0); w.count = *(size_t *)params[1]; w.divisor = *(int *)params[2]; break;
    case CAST: w.p[0] = ptr(0); w.p[1] = ptr(1); w.count = *(size_t *)params[2]; break;
    }
    launches++;
    return enqueue(s, w);
}

/* Compute capability (major 75, minor 76) of every device: HOSTCUDA_ARCH. */
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= devices) return CUDA_ERROR_INVALID_DEVICE;
    int arch = env_int("HOSTCUDA_ARCH", 90);
    if (attribute == 75) *value = arch / 10;
    else if (attribute == 76) *value = arch % 10;
    else return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    const char *text = (const char *)image;
    const char head[] = "hostcuda-module";
    if (!text || strncmp(text, head, sizeof head - 1)) return CUDA_ERROR_INVALID_IMAGE;
    const int arch = env_int("HOSTCUDA_ARCH", 90);
    int found = 0;
    for (const char *at = text + sizeof head - 1; *at;) {
        int code = 0, n = 0;
        if (sscanf(at, " sm_%d%n", &code, &n) == 1 && code == arch) found = code;
        else if (n == 0 && sscanf(at, " compute_%d%n", &code, &n) == 1 && code <= arch && !found) found = code;
        if (n == 0) {
            while (*at && *at != ' ') at++; /* a word this driver does not know */
            while (*at == ' ' || *at == '\n') at++;
        } else {
            at += n;
        }
    }
    if (!found) return CUDA_ERROR_NO_BINARY_FOR_GPU;
    *m = new CUmod_st{found};
    modules.insert(*m);
    return CUDA_SUCCESS;
}

CUresult cuModuleLoad(CUmodule *m, const char *path)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    FILE *f = fopen(path, "rb");
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    std::string image;
    char chunk[4096];
    for (size_t n; (n = fread(chunk, 1, sizeof chunk, f)) > 0;) image.append(chunk, n);
    fclose(f);
    return cuModuleLoadData(m, image.c_str());
}

CUresult cuModuleUnload(CUmodule m)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!modules.erase(m)) return CUDA_ERROR_INVALID_HANDLE;
    delete m;
    return CUDA_SUCCESS;
}

CUfunction hostcuda_function(const char *name);

CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (CUresult r = need_context()) return r;
    if (!modules.count(m)) return CUDA_ERROR_INVALID_HANDLE;
    return (*f = hostcuda_function(name)) ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* ------------------------------------------------------------- for the tests */

/* The CUfunction of a reduce.cu kernel, by name (what cupy's
 * get_function(name).ptr gives on a GPU); NULL if there is none. */
CUfunction hostcuda_function(const char *name)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    auto it = functions.find(name);
    if (it != functions.end()) return &it->second;
    CUfunc_st f{};
    Dl_info self_info;
    if (!describe(name, &f) || !dladdr((void *)&hostcuda_function, &self_info)) return nullptr;
    void *self = dlopen(self_info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    if (!self || !(f.fn = dlsym(self, name))) return nullptr;
    dlclose(self);
    return &(functions[name] = f);
}

/* Device memory handed out the way cupy would, with no context needed. */
CUdeviceptr hostcuda_alloc(size_t n)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    CUdeviceptr p = 0;
    return device_alloc(&p, n, false) == CUDA_SUCCESS ? p : 0;
}

void hostcuda_free(CUdeviceptr p)
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    auto it = device_blocks.find((uintptr_t)p);
    if (it == device_blocks.end() || it->second.api || it->second.opened) return;
    release(it->first, it->second);
    device_blocks.erase(it);
}

/* What is alive and what happened: retained contexts, streams, events,
 * cuMemAlloc blocks, pinned blocks (allocated or registered), pageable async copies, kernel
 * launches, the sticky error (0: none), other processes' memory open by IPC, registered
 * host blocks, cuIpcOpenMemHandle calls (refused ones too), and cuMemFree's of memory
 * another process still had open by IPC. */
void hostcuda_stats(long long out[12])
{
    std::lock_guard<std::recursive_mutex> lock(mu);
    long long retained = 0, api_blocks = 0, opened = 0;
    for (int d = 0; d < MAX_DEVICES; d++) retained += contexts[d].retained;
    for (auto &kv : device_blocks) {
        api_blocks += kv.second.api;
        opened += kv.second.opened;
    }
    long long v[12] = {retained, (long long)streams.size(), (long long)events.size(), api_blocks,
                       (long long)pinned_blocks.size(), pageable_copies, launches, sticky, opened,
                       (long long)registered.size(), ipc_open_calls, freed_while_open};
    memcpy(out, v, sizeof v);
}

} // extern "C"
