/* A neighbour's shared regions (shared_region.h) mapped read-only into this
 * process, so the Cross Memory Attach ring (cma.c) reduces straight out of
 * them: opened through /proc/<pid>/fd/<memfd> (the same ptrace check as
 * process_vm_readv) and kept in a small LRU cache by (pid, region id). A
 * region id is never reused, so a stale entry is memory held, never wrong
 * data; each miss drops the entries of that pid whose region it has freed
 * (its fd no longer names that memfd), so a neighbour that allocates a new
 * array every step does not have up to 16 dead ones held here. */
#ifndef RINGREDUCE_PEER_MAP_H
#define RINGREDUCE_PEER_MAP_H

#include <stddef.h>
#include <stdint.h>

#define RR_PEER_MAPS 16

typedef struct {
    int pid;
    uint64_t id;       /* 0: a free entry */
    const char *base;
    size_t length;
    uint64_t used;     /* the LRU clock when last returned */
    int fd;            /* the region's memfd in pid, and its identity: while */
    uint64_t dev, ino; /* /proc/<pid>/fd/<fd> is it, the region is alive there */
} rr_peer_mapping;

typedef struct {
    rr_peer_mapping entry[RR_PEER_MAPS];
    uint64_t clock;
} rr_peer_maps;

/* The start of region `id` of process pid (its memfd `fd` there), mapped
 * here and at least `need` bytes long; NULL when it cannot be (no access,
 * the process gone, not a sealed memfd of that size): the caller then reads
 * by process_vm_readv. */
const char *rr_peer_map(rr_peer_maps *maps, int pid, uint64_t id, int fd, size_t need);

/* Unmaps every entry. */
void rr_peer_maps_clear(rr_peer_maps *maps);

#endif
