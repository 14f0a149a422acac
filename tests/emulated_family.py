"""A device array family over the emulated device (csrc/device/device_emulated.c),
as ringreduce.core.cuda.DeviceArrays is over cupy: a rank's job that starts
with emulated_family(patience) runs the public collectives on arrays of
class Dev through the device paths (staged, or IPC where the ring agreed on
it), its device's queued work running late by `patience`."""


def emulated_family(patience: int) -> str:
    """The job code that installs the family (Emulated, Dev, device)."""
    return FAMILY.replace("{patience}", str(int(patience)))


FAMILY = """
import contextlib
from ringreduce import _core
from ringreduce.core import arrays as core_arrays, collectives as C, cuda, device_ipc
device = _core.Device.emulated({patience})

class Dev(np.ndarray):
    pass

def on_device(sizes, fill, run, read_into):
    # device buffers for the C call, the host arrays copied in and out
    ptrs = [device.alloc(max(n, 1)) for n in sizes]
    for p, a in zip(ptrs, fill):
        device.write(p, a.tobytes())
    run(*ptrs)
    for p, a in zip(ptrs, read_into):
        if a is not None:
            a.view(np.uint8).reshape(-1)[:] = np.frombuffer(device.read(p, a.nbytes), np.uint8)
    for p in ptrs:
        device.free(p)

class Emulated:
    xp = np
    asarray = staticmethod(lambda x: x)
    on = staticmethod(lambda x: contextlib.nullcontext())
    to_host = staticmethod(lambda x: np.asarray(x))
    from_host = staticmethod(lambda a, like: a.view(Dev))
    ready = staticmethod(lambda x: None)
    small_trip = staticmethod(lambda x, down=True: core_arrays._HostTrip(x))
    result = staticmethod(lambda trip, a, like: a.view(Dev))
    def allreduce(self, ring, src, dst, code, opc, all_device):
        on_device([src.nbytes, dst.nbytes], [src],
                  lambda s, d: device_ipc.allreduce(ring, device, s, d, src.nbytes, code, opc, all_device), [None, dst])
    def allreduce_small(self, x, out, reduce):
        # the small path through one of the device's pinned bounce buffers (cuda.through_bounce)
        a = np.ascontiguousarray(x)
        got = np.empty_like(a)
        went = []
        work = lambda view: reduce(np.frombuffer(view, dtype=a.dtype).reshape(a.shape))
        on_device([a.nbytes, a.nbytes], [a],
                  lambda s, d: went.append(cuda.through_bounce(device, s, d, a.nbytes, work)), [None, got])
        return got.view(Dev) if went[0] else None
    def allreduce_small_ipc(self, ring, head, src, dst, code, opc):
        ptrs = [device.alloc(max(src.nbytes, 1)), device.alloc(max(dst.nbytes, 1))]
        try:
            device.write(ptrs[0], src.tobytes())
            blobs = device_ipc.allreduce_small(ring, device, head, ptrs[0], ptrs[1], src.nbytes, code, opc)
            if blobs is None:  # reduced: dst holds the result
                dst.reshape(-1).view(np.uint8)[:] = np.frombuffer(device.read(ptrs[1], dst.nbytes), np.uint8)
            return blobs
        finally:
            for p in ptrs:
                device.free(p)
    def reduce_scatter(self, ring, src, dst, code, opc, all_device):
        on_device([src.nbytes, dst.nbytes], [src],
                  lambda s, d: device_ipc.reduce_scatter(ring, device, s, d, src.nbytes, code, opc, all_device),
                  [None, dst])
    def allgather(self, ring, flat, nbytes, all_device):
        on_device([flat.nbytes], [flat], lambda b: device_ipc.allgather(ring, device, b, nbytes, all_device), [flat])
    def broadcast(self, ring, buf, root, all_device):
        on_device([buf.nbytes], [buf], lambda b: device_ipc.broadcast(ring, device, b, buf.nbytes, root, all_device),
                  [buf])

cuda.is_device_array = lambda x: isinstance(x, Dev)
C.cuda.is_device_array = cuda.is_device_array
core_arrays.device_arrays = Emulated
"""
