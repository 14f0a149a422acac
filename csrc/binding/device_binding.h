/* ringreduce._core.Device: a device the collectives can run on (device.h),
 * for module.c. */
#ifndef RINGREDUCE_DEVICE_BINDING_H
#define RINGREDUCE_DEVICE_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include "device/device.h"

typedef struct {
    PyObject_HEAD
    rr_device *dev;
    pthread_mutex_t mu; /* one operation at a time: the device's buffers are shared */
    int emulated;
    PyObject *weakrefs; /* a ring keeps weak references to the devices it ran on (core/device_ipc.py) */
} DeviceObject;

extern PyTypeObject DeviceType;

/* ringreduce.errors.<name> (errors.c), a new reference; NULL with an exception set. */
PyObject *error_class(const char *name);

/* Sets a TypeError and returns NULL unless obj is a usable Device. */
DeviceObject *device_arg(PyObject *obj);

/* An rr_device_hold over a Device's lock (taken and let go with the GIL
 * released), for an operation that waits on peers holding it. */
rr_device_hold device_hold(DeviceObject *d);

#endif
