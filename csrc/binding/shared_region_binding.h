/* ringreduce._core.SharedRegion: a shared region (shared_region.h) as a
 * writable buffer, for module.c; ringreduce/shared.py wraps it in arrays. */
#ifndef RINGREDUCE_SHARED_REGION_BINDING_H
#define RINGREDUCE_SHARED_REGION_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyTypeObject SharedRegionType;

#endif
