/* The cache of a neighbour's mapped regions: see peer_map.h. */
#define _GNU_SOURCE
#include "memory/peer_map.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

static const char *map_region(int pid, int fd, size_t need, size_t *length, struct stat *st)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    /* Only a regular file is opened: opening a FIFO there waits for a
     * writer (for ever), a device may act on open. O_NONBLOCK covers one
     * swapped in between the two calls. */
    if (stat(path, st) != 0 || !S_ISREG(st->st_mode)) return NULL;
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (f < 0) return NULL;
    const char *base = NULL;
    /* Sealed against shrinking (shared_region.c does so), or a read could
     * fault past a shrunk end; and as large as the sender said. A file
     * that cannot be sealed answers F_GET_SEALS with -1: every bit set. */
    const int seals = fcntl(f, F_GET_SEALS);
    /* And on tmpfs, as memfd_create makes it: a hugetlbfs file reads with
     * SIGBUS once the huge-page pool runs dry. */
    struct statfs fs;
    if (fstat(f, st) == 0 && S_ISREG(st->st_mode) && (size_t)st->st_size >= need && st->st_size > 0 && seals >= 0 &&
        (seals & F_SEAL_SHRINK) && fstatfs(f, &fs) == 0 && fs.f_type == TMPFS_MAGIC) {
        void *p = mmap(NULL, (size_t)st->st_size, PROT_READ, MAP_SHARED, f, 0);
        if (p != MAP_FAILED) {
            base = p;
            *length = (size_t)st->st_size;
        }
    }
    close(f);
    return base;
}

const char *rr_peer_map(rr_peer_maps *maps, int pid, uint64_t id, int fd, size_t need)
{
    if (!id || pid <= 0 || fd < 0) return NULL;
    rr_peer_mapping *victim = &maps->entry[0];
    for (int i = 0; i < RR_PEER_MAPS; i++) {
        rr_peer_mapping *e = &maps->entry[i];
        if (e->id == id && e->pid == pid) {
            if (e->length < need) return NULL; /* a region keeps its size: the token is wrong */
            e->used = ++maps->clock;
            return e->base;
        }
        if (e->used < victim->used) victim = e;
    }
    /* A new region of pid: drop those it has freed since (one stat each,
     * on a miss only); never the one returned last, which the operation
     * may be reading (its src, this its buf). */
    for (int i = 0; i < RR_PEER_MAPS; i++) {
        rr_peer_mapping *e = &maps->entry[i];
        struct stat st;
        char path[64];
        if (!e->id || e->pid != pid || e->used == maps->clock) continue;
        snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, e->fd);
        if (stat(path, &st) == 0 && (uint64_t)st.st_dev == e->dev && (uint64_t)st.st_ino == e->ino) continue;
        munmap((void *)e->base, e->length);
        *e = (rr_peer_mapping){0};
        victim = e;
    }
    size_t length = 0;
    struct stat st;
    const char *base = map_region(pid, fd, need, &length, &st);
    if (!base) return NULL;
    if (victim->id) munmap((void *)victim->base, victim->length);
    *victim = (rr_peer_mapping){.pid = pid, .id = id, .base = base, .length = length, .used = ++maps->clock,
                                .fd = fd, .dev = (uint64_t)st.st_dev, .ino = (uint64_t)st.st_ino};
    return base;
}

void rr_peer_maps_clear(rr_peer_maps *maps)
{
    for (int i = 0; i < RR_PEER_MAPS; i++)
        if (maps->entry[i].id) munmap((void *)maps->entry[i].base, maps->entry[i].length);
    *maps = (rr_peer_maps){0};
}
