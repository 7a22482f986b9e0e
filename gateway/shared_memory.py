"""System shared-memory regions registered with this gateway process (Triton's shared_memory_manager).

Protocol-neutral: the HTTP routes (gateway/shm_routes.py) and the gRPC RPCs (gateway/grpc/shm_rpcs.py)
call the same registry, held by GatewayState as `state.shared_memory` and handed to decoders as their
`regions` (fleet.tensor_regions.Regions). A decoder calls, per tensor (`params` = the tensor's parameters
as plain Python values; gRPC: each InferParameter's set field), from fleet/tensor_regions.py:

    input_from_region(regions, name: str, datatype: Datatype, shape: Sequence[int],
                      params: Mapping[str, object]) -> bytes | None
        None when the input names no region; else its bytes, copied once out of the region and checked
        against shape and datatype. InvalidInput (gRPC: INVALID_ARGUMENT) for an unknown region, an
        offset/byte_size outside it, or a byte size the shape contradicts.
    output_to_region(regions, name: str, params: Mapping[str, object]) -> RegionSlice | None
        None when the output names no region; else a checked slice: after the reply, call
        `slice.write(name, tensor.data)` (InvalidInput if the output does not fit) and answer the output
        with its name, datatype and shape and no data (gRPC: an empty raw_output_contents entry).

Registry operations, with Triton's texts: `register(name, key, offset, byte_size)`, `unregister(name)`
("" = all; an unknown name is no error), `status(name)` ("" = all; an unknown name is NotFound), and
the CUDA answers (`cuda_*`): nothing is ever registered, registering is refused.

Keys are POSIX shared-memory names as shm_open (and tritonclient.utils.shared_memory) take them:
"/name", one object in /dev/shm. Anything else (another '/', "..", a symlink, not a regular file, no
such object) is refused, so a client cannot make the gateway map an arbitrary file. Each name maps its
own window of the object (page-aligned below its offset, so any offset works); the file descriptor is
closed at once, as Triton does (mmap keeps its own).

A region is this process's, unless the gateway processes of one host share a directory of registrations
(`--shared-memory-dir`, which `fleet up --gateways N` sets; gateway/shm_registrations.py). Otherwise, with
several gateway processes behind one address, a request may reach one that lacks the region, and gets a
400 naming it. Registration is not shared through Redis on purpose: a key names an object on one host
only, and another host's gateway would map a different object, or none, under the same key.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from fleet.errors import InvalidInput, NotFound, TooLarge
from fleet.tensor_regions import RegionRef, RegionSlice
from gateway.shm_registrations import Identity, Registration, RegistrationFiles

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Each region is one memory mapping; the kernel allows a process ~65k (vm.max_map_count), and malloc and
# numpy need some of them. A client registering without end gets a 400, not a gateway that cannot
# allocate.
MAX_REGIONS = 4096
CUDA_UNSUPPORTED = "CUDA shared memory is not supported by this gateway"


@dataclass(frozen=True, slots=True, eq=False)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    map: mmap.mmap  # the window [map_start, map_start + len(map)) of the object
    map_start: int  # offset of the window in the object: `offset` rounded down to the mmap granularity
    writable: bool

    def status(self) -> dict[str, str | int]:
        return Registration(self.name, self.key, self.offset, self.byte_size).status()


@dataclass(frozen=True, slots=True, eq=False)
class _Slice:
    """A RegionSlice: holds the region (and so its mapping) until the request is answered."""

    ref: RegionRef
    region: _Region
    max_read_bytes: int

    def _bounds(self, size: int) -> tuple[int, int]:
        start = self.region.offset - self.region.map_start + self.ref.offset
        # A client may shrink the object after registering it: touching pages past its end would kill
        # the process (SIGBUS), so its current size (fstat on mmap's own descriptor) is checked each time.
        if self.region.map_start + start + size > self.region.map.size():
            raise InvalidInput(f"shared memory region '{self.ref.region}': its object '{self.region.key}' "
                               f"shrank to {self.region.map.size()} bytes after it was registered")
        return start, start + size

    def read(self) -> bytes:
        if self.ref.byte_size > self.max_read_bytes:
            # The bytes go into the request's envelope and through Redis, as a body's would: same cap.
            raise TooLarge(f"{self.ref.byte_size} bytes of shared memory region '{self.ref.region}' exceed the "
                           f"limit of {self.max_read_bytes} bytes an input may carry (FLEET_MAX_INPUT_BYTES)")
        start, end = self._bounds(self.ref.byte_size)
        return self.region.map[start:end]

    def write(self, output: str, data: bytes | memoryview) -> None:
        if len(data) > self.ref.byte_size:
            raise InvalidInput(f"shared memory size specified with the request for output '{output}' "
                               f"({self.ref.byte_size} bytes) should be at least {len(data)} bytes to hold "
                               f"the results")
        if not self.region.writable:
            raise InvalidInput(f"output '{output}': shared memory region '{self.ref.region}' is read-only to "
                               f"the gateway (its object '{self.region.key}' cannot be opened for writing)")
        start, end = self._bounds(len(data))
        self.region.map[start:end] = data


def _object_name(name: str, key: str) -> str:
    """The /dev/shm entry of `key`: shm_open's "/name" (a bare "name" too, as glibc takes it)."""
    bare = key[1:] if key.startswith("/") else key
    if not bare or "/" in bare or bare in (".", "..") or "\0" in bare:
        raise InvalidInput(f"failed to register shared memory region '{name}': key '{key}' is not a POSIX "
                           f"shared memory name ('/' and a name without '/', an object in {SHM_DIR})")
    return bare


def _open(name: str, key: str) -> tuple[int, bool]:
    """(descriptor, writable) of key's object; read-only if the gateway may not write it."""
    path = SHM_DIR / _object_name(name, key)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC  # a symlink in /dev/shm must not lead the gateway elsewhere
    try:
        try:
            fd, writable = os.open(path, os.O_RDWR | flags), True
        except PermissionError:
            fd, writable = os.open(path, os.O_RDONLY | flags), False
    except FileNotFoundError:
        raise InvalidInput(f"Unable to open shared memory region: '{key}' (no such object in {SHM_DIR}; "
                           f"create it on the gateway's host first)") from None
    except OSError as exc:
        raise InvalidInput(f"Unable to open shared memory region: '{key}': {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidInput(f"Unable to open shared memory region: '{key}' is not a shared memory object")
    return fd, writable


def _map(name: str, key: str, offset: int, byte_size: int) -> _Region:
    fd, writable = _open(name, key)
    try:
        size = os.fstat(fd).st_size
        if offset + byte_size > size:
            raise InvalidInput(f"failed to register shared memory region '{name}': invalid args (offset {offset} "
                               f"+ byte_size {byte_size} is past the end of '{key}', {size} bytes)")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        try:
            window = mmap.mmap(fd, offset + byte_size - start, access=access, offset=start)
        except OSError as exc:
            raise InvalidInput(f"failed to register shared memory region '{name}': {exc.strerror}") from None
    finally:
        os.close(fd)
    return _Region(name, key, offset, byte_size, window, start, writable)


class SharedMemoryRegistry:
    """The regions of one gateway process by name; with `shared_dir`, the regions registered with any
    gateway process sharing that directory (gateway/shm_registrations.py), mapped here on first use.
    Thread-safe (the gRPC server may run handlers on threads); reads and writes of tensors take no lock:
    a slice holds what it needs."""

    def __init__(self, max_read_bytes: int = 64 * 1024 * 1024, shared_dir: Path | None = None) -> None:
        self._regions: dict[str, _Region] = {}
        self._max_read_bytes = max_read_bytes  # per input read from a region (Settings.max_input_bytes)
        self._lock = threading.Lock()
        self._files = RegistrationFiles(shared_dir) if shared_dir is not None else None
        self._mapped: dict[str, Identity] = {}  # with _files: the registration each mapped region came from

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map `byte_size` bytes at `offset` of shared-memory object `key` as region `name`. Raises
        InvalidInput: name already registered (Triton: "already in manager"), bad key, no such object,
        out of its bounds, an empty region, or too many regions."""
        if not name:
            raise InvalidInput("'region name' is necessary to register system shared memory region")
        if byte_size < 1:
            raise InvalidInput(f"failed to register shared memory region '{name}': byte_size must be at least 1")
        with self._lock:
            files = self._files
            registered = name in self._regions if files is None else files.identity(name) is not None
            if registered:
                raise InvalidInput(f"shared memory region '{name}' already in manager")
            if (len(self._regions) if files is None else files.count()) >= MAX_REGIONS:
                holder = "this gateway holds" if files is None else "this host's gateways hold"
                raise InvalidInput(f"failed to register shared memory region '{name}': {holder} "
                                   f"{MAX_REGIONS} regions already; unregister some first")
            region = _map(name, key, offset, byte_size)
            if files is not None:
                identity = files.publish(Registration(name, key, offset, byte_size))
                if identity is None:  # by another process, meanwhile
                    raise InvalidInput(f"shared memory region '{name}' already in manager")
                self._mapped[name] = identity
            self._regions[name] = region

    def unregister(self, name: str = "") -> None:
        """Forget region `name` ("" = every region); an unknown name is no error (Triton). In-flight
        requests keep their slices; the mapping goes when the last one is answered."""
        with self._lock:
            if name:
                self._regions.pop(name, None)
                self._mapped.pop(name, None)
                if self._files is not None:
                    self._files.remove(name)
            else:
                self._regions.clear()
                self._mapped.clear()
                if self._files is not None:
                    self._files.remove_all()

    def sweep(self) -> None:
        """With shared registrations: unmap what another process unregistered (or registered anew) since
        this one mapped it, so an idle gateway does not keep a client's released pages. The gateway calls
        it every few seconds; in-flight requests keep their slices."""
        if self._files is None:
            return
        with self._lock:
            try:
                self._drop_stale()
            except OSError as exc:  # the directory unreadable a moment: the next sweep, or lookup, retries
                log.warning("shared-memory registrations in %s: %s", self._files.directory, exc)

    def status(self, name: str = "") -> list[dict[str, str | int]]:
        """Triton's status objects (name, key, offset, byte_size) of region `name`, or of all ("");
        NotFound for an unknown name."""
        if self._files is not None:
            found: list[dict[str, str | int]] = [r.status() for r in self._files.all() if not name or r.name == name]
            if name and not found:
                raise NotFound(f"Unable to find system shared memory region: '{name}'")
            return found
        with self._lock:
            if not name:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    def slice(self, ref: RegionRef) -> RegionSlice:
        """Region `ref.region`'s bytes [offset, offset + byte_size), checked as Triton's GetMemoryInfo does.
        InvalidInput: unregistered (with this process), offset or end outside the region."""
        with self._lock:
            region = self._regions.get(ref.region) if self._files is None else self._current(ref.region)
        if region is None:
            alone = "" if self._files is not None else (" (not registered with this gateway process; each gateway "
                                                        "process has its own regions)")
            raise InvalidInput(f"Unable to find shared memory region: '{ref.region}'{alone}")
        if ref.offset >= region.byte_size:
            raise InvalidInput(f"Invalid offset for shared memory region: '{ref.region}' (offset {ref.offset}, "
                               f"the region has {region.byte_size} bytes)")
        if ref.offset + ref.byte_size > region.byte_size:
            raise InvalidInput(f"Invalid offset + byte size for shared memory region: '{ref.region}' (offset "
                               f"{ref.offset} + byte size {ref.byte_size} > {region.byte_size} bytes)")
        return _Slice(ref, region, self._max_read_bytes)

    def _current(self, name: str) -> _Region | None:
        """With shared registrations (lock held): the region registered as `name` now, mapped here. A stat
        a lookup; the file is read and the object mapped only when the registration changed."""
        assert self._files is not None
        identity = self._files.identity(name)
        if identity is not None and self._mapped.get(name) == identity and name in self._regions:
            return self._regions[name]
        self._regions.pop(name, None)  # other stale regions: the sweep unmaps them (sweep())
        self._mapped.pop(name, None)
        found = self._files.read(name) if identity is not None else None
        if found is None:
            return None
        identity, reg = found
        try:
            self._regions[name] = _map(name, reg.key, reg.offset, reg.byte_size)
        except InvalidInput:  # its object removed or shrunk since it was registered
            raise InvalidInput(f"Unable to open shared memory region: '{reg.key}' (registered as '{name}'; no "
                               f"longer there in the size registered)") from None
        self._mapped[name] = identity
        return self._regions[name]

    def _drop_stale(self) -> None:
        """(Lock held.) Unmap every region whose registration is gone or was made anew elsewhere."""
        assert self._files is not None
        for name in [n for n in self._regions if self._files.identity(n) != self._mapped.get(n)]:
            del self._regions[name]
            self._mapped.pop(name, None)

    # CUDA shared memory: no region is ever registered, so status lists none and unregistering succeeds,
    # as Triton answers with nothing registered (tritonclient's examples unregister everything first).

    def cuda_status(self, name: str = "") -> list[dict[str, object]]:
        if not name:
            return []
        with self._lock:
            system = name in self._regions if self._files is None else self._files.identity(name) is not None
        if system:
            raise NotFound(f"The region named '{name}' is registered as system shared memory, not CUDA shared "
                           f"memory")
        raise NotFound(f"Unable to find cuda shared memory region: '{name}'")

    def cuda_register(self, name: str) -> None:
        raise InvalidInput(f"failed to register CUDA shared memory region '{name}': {CUDA_UNSUPPORTED}")

    def cuda_unregister(self, name: str = "") -> None:
        return None
