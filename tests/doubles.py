"""Test doubles shared by the CPU and GPU tests."""


class DLPackOnly:
    """Exposes only the DLPack protocol of the array it wraps (no __cuda_array_interface__)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()
