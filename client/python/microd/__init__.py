# SPDX-License-Identifier: Apache-2.0
"""microd: hand gradient buffers to the node's microd daemon (ctypes binding).

    import microd
    with microd.Client() as c:                 # socket from $MICROD_SOCKET
        buf = c.register("grads", 1000)        # shared memory, zero copy
        buf.array[:] = gradients               # numpy view (buf.tensor: torch)
        c.allreduce(buf)                       # buf.array now holds the update

Every non-OK status of the C library raises the MicrodError subclass of its
code, carrying the daemon's message.
"""
import builtins
import ctypes
import ctypes.util
import enum
import os

import numpy as np

__all__ = [
    "Status", "MicrodError", "InvalidArgumentError", "UnavailableError", "MicrodTimeoutError",
    "MismatchError", "JobFailedError", "UnsupportedError", "ProtocolError", "ResourceError",
    "PermissionDeniedError", "NonFiniteError", "InternalError", "ClosedError",
    "MembershipChangedError",
    "Client", "Buffer", "CudaBuffer", "JobInfo", "library_path",
]


class Status(enum.IntEnum):
    """Values of microd_status (client/include/microd/microd.h)."""
    OK = 0
    INVALID_ARGUMENT = 1
    UNAVAILABLE = 2
    TIMEOUT = 3
    MISMATCH = 4
    JOB_FAILED = 5
    UNSUPPORTED = 6
    PROTOCOL = 7
    RESOURCE = 8
    PERMISSION = 9
    NONFINITE = 10
    INTERNAL = 11
    CLOSED = 12
    MEMBERSHIP = 13


class MicrodError(Exception):
    """A microd call failed; `status` is the Status, `message` the daemon's text."""
    status = None

    def __init__(self, status, message):
        super().__init__(f"{Status(status).name if status in Status._value2member_map_ else status}: {message}")
        self.status = status
        self.message = message


class InvalidArgumentError(MicrodError): pass
class UnavailableError(MicrodError): pass
class MicrodTimeoutError(MicrodError, builtins.TimeoutError):
    """MICROD_ERR_TIMEOUT; also a built-in TimeoutError, so `except
    TimeoutError` catches it."""


# The name the binding had before; the same class (not the built-in).
TimeoutError = MicrodTimeoutError  # noqa: A001
class MismatchError(MicrodError): pass
class JobFailedError(MicrodError): pass
class UnsupportedError(MicrodError): pass
class ProtocolError(MicrodError): pass
class ResourceError(MicrodError): pass
class PermissionDeniedError(MicrodError): pass
class NonFiniteError(MicrodError): pass
class InternalError(MicrodError): pass
class ClosedError(MicrodError): pass


class MembershipChangedError(MicrodError):
    """MICROD_ERR_MEMBERSHIP: an elastic job's membership changed; the step
    was not applied on any node. `rank` and `world_size` are this process's
    in the new membership (also the client's `rank`, `world_size`, `job`
    from now on); `epoch` the new membership's. Write the gradient again and
    submit again."""
    rank = None
    world_size = None
    epoch = None


_ERRORS = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.UNAVAILABLE: UnavailableError,
    Status.TIMEOUT: MicrodTimeoutError,
    Status.MISMATCH: MismatchError,
    Status.JOB_FAILED: JobFailedError,
    Status.UNSUPPORTED: UnsupportedError,
    Status.PROTOCOL: ProtocolError,
    Status.RESOURCE: ResourceError,
    Status.PERMISSION: PermissionDeniedError,
    Status.NONFINITE: NonFiniteError,
    Status.INTERNAL: InternalError,
    Status.CLOSED: ClosedError,
    Status.MEMBERSHIP: MembershipChangedError,
}

BUFFER_DENSE = 1


class _Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("socket_path", ctypes.c_char_p),
                ("local_rank", ctypes.c_int32), ("timeout_ms", ctypes.c_int32)]


class _BufferOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("flags", ctypes.c_uint32),
                ("dtype", ctypes.c_uint32)]


# microd_dtype: the element types of a buffer (the daemon works in fp32).
DTYPES = {"float32": 1, "bfloat16": 2, "float16": 3}


def dtype_name(dtype):
    """'float32', 'bfloat16' or 'float16' for a numpy or torch dtype (or one
    of those names); InvalidArgumentError for anything else."""
    if isinstance(dtype, str):
        name = dtype
    elif "torch" in type(dtype).__module__:
        name = str(dtype).replace("torch.", "")  # torch.bfloat16 -> bfloat16
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = {"float": "float32", "half": "float16"}.get(name, name)
    if name not in DTYPES:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                   f"dtype {dtype!r}: microd buffers are float32, bfloat16 or "
                                   f"float16")
    return name


class _JobInfo(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int32), ("world_size", ctypes.c_int32),
                ("local_rank", ctypes.c_int32), ("local_size", ctypes.c_int32),
                ("node_rank", ctypes.c_int32), ("node_count", ctypes.c_int32)]


def _prefix_library_dirs(prefix):
    """Library folders of an install prefix (GNUInstallDirs' choices)."""
    import sysconfig
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [os.path.join(prefix, "lib")]
    if multiarch:
        dirs.append(os.path.join(prefix, "lib", multiarch))
    dirs.append(os.path.join(prefix, "lib64"))
    return dirs


def library_path():
    """Where libmicrod is loaded from (first match wins): $MICROD_LIBRARY; the
    package's own folder; the library folder of the prefix the package is
    installed in (`cmake --install build --prefix P` and `pip install --prefix
    P client/python` side by side, or a virtual environment), then of
    $MICROD_PREFIX; the repository's build tree; the system's library path
    (ldconfig), then /usr/local/lib."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("MICROD_LIBRARY", ""), os.path.join(here, "libmicrod.so")]
    # <prefix>/lib/pythonX.Y/site-packages/microd (pip) or
    # <prefix>/lib/python3/dist-packages/microd (Debian): the prefix is 3 up.
    prefixes = [os.path.normpath(os.path.join(here, "..", "..", "..", ".."))]
    if os.path.basename(prefixes[0]) == "local":
        # Debian's pip puts `--prefix P` installs under P/local.
        prefixes.append(os.path.dirname(prefixes[0]))
    if os.environ.get("MICROD_PREFIX"):
        prefixes.insert(0, os.environ["MICROD_PREFIX"])
    for prefix in prefixes:
        candidates += [os.path.join(d, "libmicrod.so") for d in _prefix_library_dirs(prefix)]
    candidates.append(os.path.join(here, "..", "..", "..", "build", "client", "libmicrod.so"))
    for c in candidates:
        if c and os.path.exists(c):
            return os.path.abspath(c)
    found = ctypes.util.find_library("microd")
    if found:
        return found
    for d in _prefix_library_dirs("/usr/local"):
        if os.path.exists(os.path.join(d, "libmicrod.so")):
            return os.path.join(d, "libmicrod.so")
    raise OSError("libmicrod not found: build it (make test), install it (cmake --install), "
                  "or set MICROD_LIBRARY (or MICROD_PREFIX)")


_lib = None


def _library():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        c = ctypes
        lib.microd_version.restype = c.c_int
        lib.microd_status_string.restype = c.c_char_p
        lib.microd_status_string.argtypes = [c.c_int]
        lib.microd_options_init.argtypes = [c.POINTER(_Options)]
        lib.microd_connect.argtypes = [c.POINTER(_Options), c.POINTER(c.c_void_p)]
        lib.microd_last_error.restype = c.c_char_p
        lib.microd_last_error.argtypes = [c.c_void_p]
        lib.microd_job_info_get.argtypes = [c.c_void_p, c.POINTER(_JobInfo)]
        lib.microd_job_epoch.argtypes = [c.c_void_p, c.POINTER(c.c_uint64)]
        lib.microd_momentum_correction.argtypes = [c.c_void_p, c.POINTER(c.c_float)]
        lib.microd_buffer_options_init.argtypes = [c.POINTER(_BufferOptions)]
        lib.microd_register_typed_buffer.argtypes = [c.c_void_p, c.c_char_p, c.c_uint64,
                                                     c.POINTER(_BufferOptions),
                                                     c.POINTER(c.c_void_p), c.POINTER(c.c_int32)]
        lib.microd_register_cuda_buffer.argtypes = [c.c_void_p, c.c_char_p, c.c_void_p,
                                                    c.c_uint64, c.POINTER(_BufferOptions),
                                                    c.POINTER(c.c_int32)]
        lib.microd_allreduce_async.argtypes = [c.c_void_p, c.c_int32, c.POINTER(c.c_uint64)]
        lib.microd_allreduce_cuda_async.argtypes = [c.c_void_p, c.c_int32, c.c_void_p,
                                                    c.POINTER(c.c_uint64)]
        lib.microd_wait.argtypes = [c.c_void_p, c.c_uint64, c.c_int32]
        lib.microd_close.argtypes = [c.c_void_p]
        lib.microd_state_save.argtypes = [c.c_void_p, c.c_char_p, c.c_int32]
        lib.microd_state_load.argtypes = [c.c_void_p, c.c_char_p, c.c_int32]
        _lib = lib
    return _lib


def version():
    return _library().microd_version()


class JobInfo:
    def __init__(self, info):
        self.rank = info.rank
        self.world_size = info.world_size
        self.local_rank = info.local_rank
        self.local_size = info.local_size
        self.node_rank = info.node_rank
        self.node_count = info.node_count

    def __repr__(self):
        return (f"JobInfo(rank={self.rank}, world_size={self.world_size}, "
                f"local_rank={self.local_rank}, local_size={self.local_size}, "
                f"node_rank={self.node_rank}, node_count={self.node_count})")


class Buffer:
    """A registered buffer: `array` is a numpy view of the shared memory
    (valid until the client closes): float32 or float16, and for bfloat16,
    which numpy lacks, its raw bits as uint16; `tensor` a torch view of the
    same memory in the buffer's dtype (as for CudaBuffer; torch is imported at
    the first use)."""

    def __init__(self, client, name, buffer_id, array, dense, dtype="float32"):
        self.client = client
        self.name = name
        self.id = buffer_id
        self.array = array
        self.dense = dense
        self.dtype = dtype
        self._tensor = None

    @property
    def count(self):
        return self.array.shape[0]

    @property
    def tensor(self):
        if self._tensor is None:
            import torch
            if self.dtype == "bfloat16":  # torch has no uint16: the same bits as int16
                self._tensor = torch.from_numpy(self.array.view(np.int16)).view(torch.bfloat16)
            else:
                self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def __repr__(self):
        return f"Buffer({self.name!r}, count={self.count}, id={self.id})"


class CudaBuffer:
    """A registered buffer in GPU memory: the daemon reads the gradient from it
    and writes the update into it in place (CUDA IPC, no copy through this
    process). `tensor` is the torch tensor it was registered from (None when
    registered by device pointer); it must stay allocated until the client
    closes."""

    def __init__(self, client, name, buffer_id, device_ptr, count, dense, tensor=None):
        self.client = client
        self.name = name
        self.id = buffer_id
        self.device_ptr = device_ptr
        self.count = count
        self.dense = dense
        self.tensor = tensor

    def __repr__(self):
        return f"CudaBuffer({self.name!r}, count={self.count}, id={self.id})"


def _cuda_target(memory, count):
    """(device pointer, count, tensor or None) of what register_cuda was given."""
    if isinstance(memory, int):
        if count is None or int(count) <= 0:
            raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                       "a device pointer needs a positive element count")
        return memory, int(count), None
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not isinstance(memory, torch.Tensor):
        raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                   f"register_cuda takes a CUDA tensor or a device pointer, "
                                   f"not {type(memory).__name__}")
    if not memory.is_cuda:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                   f"the tensor is on {memory.device}, not a CUDA device: "
                                   f"register host memory with register()")
    if memory.dtype != torch.float32:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                   f"the tensor is {memory.dtype}; microd averages float32")
    if not memory.is_contiguous():
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, "the tensor is not contiguous")
    if count is not None and int(count) != memory.numel():
        raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                   f"count {count} differs from the tensor's {memory.numel()} "
                                   f"elements")
    return memory.data_ptr(), memory.numel(), memory


class Client:
    """A connection to this node's microd (one per training process)."""

    def __init__(self, socket_path=None, local_rank=-1, timeout_ms=60000):
        lib = _library()
        opts = _Options()
        lib.microd_options_init(ctypes.byref(opts))
        self._socket = socket_path.encode() if socket_path else None
        opts.socket_path = self._socket
        opts.local_rank = local_rank
        opts.timeout_ms = timeout_ms
        handle = ctypes.c_void_p()
        status = lib.microd_connect(ctypes.byref(opts), ctypes.byref(handle))
        if status != Status.OK:
            raise _error(status, lib.microd_last_error(None))
        self._handle = handle
        info = _JobInfo()
        self._check(lib.microd_job_info_get(handle, ctypes.byref(info)))
        self.job = JobInfo(info)
        beta = ctypes.c_float(0)
        self._check(lib.microd_momentum_correction(handle, ctypes.byref(beta)))
        #: The daemon's momentum correction factor (0: off): when set, the
        #: daemon applies momentum and the optimizer must not.
        self.momentum_correction = float(beta.value)
        self.buffers = {}

    # Job shape.
    rank = property(lambda self: self.job.rank)
    world_size = property(lambda self: self.job.world_size)
    local_rank = property(lambda self: self.job.local_rank)
    local_size = property(lambda self: self.job.local_size)
    node_rank = property(lambda self: self.job.node_rank)
    node_count = property(lambda self: self.job.node_count)

    @property
    def epoch(self):
        """The job's membership epoch as this process last heard it (0 as
        the job formed; one more at each change)."""
        epoch = ctypes.c_uint64(0)
        self._check(_library().microd_job_epoch(self._live(), ctypes.byref(epoch)))
        return int(epoch.value)

    def _check(self, status):
        if status == Status.MEMBERSHIP:
            # The library read the new membership before this answer.
            lib = _library()
            err = _error(status, lib.microd_last_error(self._live()))
            info = _JobInfo()
            if lib.microd_job_info_get(self._live(), ctypes.byref(info)) == Status.OK:
                self.job = JobInfo(info)
            err.rank, err.world_size, err.epoch = self.rank, self.world_size, self.epoch
            raise err
        if status != Status.OK:
            raise _error(status, _library().microd_last_error(self._live()))

    def _live(self):
        if self._handle is None:
            raise ClosedError(Status.CLOSED, "the client is closed")
        return self._handle

    def _buffer_options(self, name, dense):
        """The C options of a new buffer `name`; refuses a name already taken."""
        if name in self.buffers:
            raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"buffer '{name}' already registered")
        opts = _BufferOptions()
        _library().microd_buffer_options_init(ctypes.byref(opts))
        opts.flags = BUFFER_DENSE if dense else 0
        return opts

    def register(self, name, count, dense=False, dtype="float32"):
        """Allocates `count` elements in shared memory and registers them under
        `name` (the same on every process, with the same count and dtype).
        `dense`: never sparsify. `dtype`: float32, bfloat16 or float16 (a numpy
        or torch dtype, or its name); the daemon widens bf16/fp16 gradients,
        steps in fp32 and writes the update back rounded to nearest-even."""
        dtype = dtype_name(dtype)
        opts = self._buffer_options(name, dense)
        opts.dtype = DTYPES[dtype]
        lib = _library()
        data = ctypes.c_void_p()
        buffer_id = ctypes.c_int32(-1)
        self._check(lib.microd_register_typed_buffer(self._live(), name.encode(), int(count),
                                                     ctypes.byref(opts), ctypes.byref(data),
                                                     ctypes.byref(buffer_id)))
        element = {"float32": ctypes.c_float, "bfloat16": ctypes.c_uint16,
                   "float16": ctypes.c_uint16}[dtype]
        array = np.ctypeslib.as_array(ctypes.cast(data, ctypes.POINTER(element)),
                                      shape=(int(count),))
        if dtype == "float16":
            array = array.view(np.float16)
        buf = Buffer(self, name, buffer_id.value, array, dense, dtype)
        self.buffers[name] = buf
        return buf

    def register_cuda(self, name, memory, count=None, dense=False):
        """Registers GPU memory under `name` (the same on every process): a
        contiguous float32 CUDA tensor, or a device pointer (int) with `count`.
        The daemon maps it with CUDA IPC and writes each update into it in
        place. Loads the CUDA driver on first use; UnsupportedError when this
        process or the daemon has no usable GPU (see microd.h)."""
        opts = self._buffer_options(name, dense)
        ptr, n, tensor = _cuda_target(memory, count)
        lib = _library()
        buffer_id = ctypes.c_int32(-1)
        self._check(lib.microd_register_cuda_buffer(self._live(), name.encode(),
                                                    ctypes.c_void_p(ptr), n, ctypes.byref(opts),
                                                    ctypes.byref(buffer_id)))
        buf = CudaBuffer(self, name, buffer_id.value, ptr, n, dense, tensor)
        self.buffers[name] = buf
        return buf

    def allreduce_async(self, buffer, stream=None):
        """Submits the buffer; returns a ticket for wait(). For a CudaBuffer,
        `stream` is where its gradient was produced (a torch.cuda.Stream or a
        raw cudaStream_t as int): the daemon reads it once the work queued
        there is done. Default: torch's current stream of the tensor's device
        (the legacy default stream for a buffer registered by pointer)."""
        ticket = ctypes.c_uint64(0)
        if isinstance(buffer, CudaBuffer):
            handle = _stream_handle(buffer, stream)
            self._check(_library().microd_allreduce_cuda_async(
                self._live(), buffer.id, ctypes.c_void_p(handle), ctypes.byref(ticket)))
        elif stream is not None:
            raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                       f"buffer '{buffer.name}' is a host buffer: no CUDA stream")
        else:
            self._check(_library().microd_allreduce_async(self._live(), buffer.id,
                                                          ctypes.byref(ticket)))
        return ticket.value

    def wait(self, ticket, timeout_ms=-1):
        """Waits for a ticket (timeout_ms < 0: no limit). Releases the GIL."""
        self._check(_library().microd_wait(self._live(), ticket, int(timeout_ms)))

    def allreduce(self, buffer, timeout_ms=-1, stream=None):
        self.wait(self.allreduce_async(buffer, stream), timeout_ms)

    def save_state(self, directory, timeout_ms=-1):
        """Saves the daemons' compression state (residuals, velocities,
        thresholds, step counters) into `directory`, one file per node.
        Collective: every process of the job calls it at the same point, after
        its allreduces completed (next to torch.save of the model)."""
        self._check(_library().microd_state_save(self._live(), os.fsencode(directory),
                                                 int(timeout_ms)))

    def load_state(self, directory, timeout_ms=-1):
        """Loads what save_state wrote, after registering every buffer and
        before the first allreduce; MismatchError when the job differs from
        the saved one or a file is damaged (nothing is loaded then).
        Collective, like save_state."""
        self._check(_library().microd_state_load(self._live(), os.fsencode(directory),
                                                 int(timeout_ms)))

    def close(self):
        if self._handle is not None:
            for b in self.buffers.values():
                if isinstance(b, Buffer):
                    b.array = None  # the shared memory goes with the client
            _library().microd_close(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _stream_handle(buffer, stream):
    """The cudaStream_t (int, 0 = legacy default stream) for a submission."""
    if stream is None:
        if buffer.tensor is None:
            return 0
        import torch
        return torch.cuda.current_stream(buffer.tensor.device).cuda_stream
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if not isinstance(handle, int):
        raise InvalidArgumentError(Status.INVALID_ARGUMENT,
                                   f"stream must be a torch.cuda.Stream or an int, not "
                                   f"{type(stream).__name__}")
    return handle


def _error(status, message):
    text = message.decode(errors="replace") if isinstance(message, bytes) else str(message)
    cls = _ERRORS.get(status, MicrodError)
    return cls(status, text)
