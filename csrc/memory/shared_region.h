/* Arrays in shared memory (ringreduce.shared_empty), as NCCL's
 * ncclMemAlloc, MPI_Alloc_mem or XPMEM's exported segments: a region is a
 * memfd mapped MAP_SHARED by the process that made it, which keeps a
 * registry of its live regions. A buffer wholly inside one can be mapped by
 * a neighbour on the same host (peer_map.h) and read without any copy:
 * the Cross Memory Attach ring (cma.c) says so in its token. */
#ifndef RINGREDUCE_SHARED_REGION_H
#define RINGREDUCE_SHARED_REGION_H

#include <stddef.h>
#include <stdint.h>

/* Where a buffer lies in this process's regions: id 0 when not wholly in one. */
typedef struct {
    uint64_t id;     /* unique in this process, never reused; random high bits, so a pid reused
                        by another process does not bring the same ids back */
    uint64_t offset; /* of the buffer from the region's start */
    int fd;          /* the region's memfd in this process */
} rr_region_ref;

/* A new zero-filled region of at least `bytes` bytes (a whole number of
 * pages, one at least), registered. NULL with errno set on failure. */
void *rr_region_create(size_t bytes, size_t *length, uint64_t *id);

/* Unregisters the region at base (from rr_region_create), unmaps and closes it. */
void rr_region_free(void *base);

/* The region holding all n bytes at p, if any. */
rr_region_ref rr_region_find(const void *p, size_t n);

#endif
