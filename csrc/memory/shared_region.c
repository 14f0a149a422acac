/* The registry of this process's shared regions: see shared_region.h. */
#define _GNU_SOURCE
#include "memory/shared_region.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    char *base;
    size_t length;
    uint64_t id;
    int fd;
    dev_t dev; /* the memfd's identity: the fd number may come to name */
    ino_t ino; /* something else (os.dup2, a close and a reuse) */
} region;

/* Few live regions (a model's gradient buffers), freed from any thread by
 * the garbage collector: an array under a mutex. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static region *regions;
static size_t count, capacity;
static uint64_t next_id;

/* A child of fork() draws new random high bits: with its parent's it would
 * hand out the ids its parent does, and a neighbour whose cache holds
 * (pid, id) from an earlier process of that pid (its sibling) would read
 * that dead region's bytes. The lock keeps the registry whole across fork. */
static void before_fork(void) { pthread_mutex_lock(&mu); }
static void after_fork_parent(void) { pthread_mutex_unlock(&mu); }
static void after_fork_child(void)
{
    next_id = 0;
    pthread_mutex_unlock(&mu);
}
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void watch_fork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static uint64_t new_id(void)
{
    if (!next_id) {
        uint32_t r = 0;
        if (getrandom(&r, sizeof r, GRND_NONBLOCK) != sizeof r) { /* the time too: a reused pid gets other ids */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            r = ((uint32_t)getpid() ^ (uint32_t)ts.tv_nsec ^ (uint32_t)ts.tv_sec) * 2654435761u;
        }
        next_id = (uint64_t)r << 32;
    }
    return ++next_id; /* never 0: 0 means "no region" in a token */
}

void *rr_region_create(size_t bytes, size_t *length, uint64_t *id)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (bytes > SIZE_MAX - page) { errno = ENOMEM; return NULL; }
    size_t n = bytes ? (bytes + page - 1) / page * page : page;
    /* A memfd's pages come at first touch: a region larger than memory and
     * swap would be handed out and kill the process (or the OOM killer's
     * pick) when written. Refused as numpy's np.empty refuses it. */
    struct sysinfo si;
    if (sysinfo(&si) == 0 && si.mem_unit &&
        n / si.mem_unit > (size_t)si.totalram + (size_t)si.totalswap) { errno = ENOMEM; return NULL; }
    int fd = memfd_create("ringreduce-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return NULL;
    /* Sealed at its size: a reader's mapping can never run past the end
     * of a shrunk file (SIGBUS); peer_map.c refuses an unsealed one. */
    if (ftruncate(fd, (off_t)n) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return NULL;
    }
    struct stat st;
    char *base = fstat(fd, &st) == 0 ? mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (base == MAP_FAILED) {
        int e = errno;
        close(fd);
        errno = e;
        return NULL;
    }
    pthread_once(&fork_once, watch_fork);
    pthread_mutex_lock(&mu);
    if (count == capacity) {
        size_t c = capacity ? 2 * capacity : 16;
        region *grown = realloc(regions, c * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&mu);
            munmap(base, n);
            close(fd);
            errno = ENOMEM;
            return NULL;
        }
        regions = grown;
        capacity = c;
    }
    region *g = &regions[count++];
    *g = (region){.base = base, .length = n, .id = new_id(), .fd = fd, .dev = st.st_dev, .ino = st.st_ino};
    *length = n;
    *id = g->id;
    pthread_mutex_unlock(&mu);
    return base;
}

void rr_region_free(void *base)
{
    if (!base) return;
    region gone = {0};
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < count; i++)
        if (regions[i].base == base) {
            gone = regions[i];
            regions[i] = regions[--count];
            break;
        }
    pthread_mutex_unlock(&mu);
    if (!gone.base) return;
    munmap(gone.base, gone.length);
    /* Only while the number is still our memfd: a child that closed what it
     * inherited (closerange) may have opened its ring's sockets there. */
    struct stat st;
    if (fstat(gone.fd, &st) == 0 && st.st_dev == gone.dev && st.st_ino == gone.ino) close(gone.fd);
}

rr_region_ref rr_region_find(const void *p, size_t n)
{
    rr_region_ref ref = {0, 0, -1};
    const char *c = p;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < count; i++) {
        const region *g = &regions[i];
        if (c >= g->base && c <= g->base + g->length && n <= (size_t)(g->base + g->length - c)) {
            /* A neighbour opens the fd named in the token: only while it
             * still names this region's memfd (else it reads by
             * process_vm_readv). */
            struct stat st;
            if (fstat(g->fd, &st) != 0 || st.st_dev != g->dev || st.st_ino != g->ino) break;
            ref = (rr_region_ref){.id = g->id, .offset = (uint64_t)(c - g->base), .fd = g->fd};
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return ref;
}
