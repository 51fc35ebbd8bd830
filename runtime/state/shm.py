"""Snapshot records in a node's host memory: file-backed shared memory under /dev/shm, two slots and a commit record
per file, each slot checksummed. Torch-free: the node agent takes inventories with it, workers write and read.

Why this shape (the design notes have the measurements): a file under /dev/shm survives the SIGKILL of the process that wrote it (it is the
node's memory, owned by its agent, and lost with the node), and copying into pages already touched runs about ten
times faster than into fresh ones, so a record's file is allocated and touched once and then reused.

Layout of one file: two slot headers (the commit records) in the first page, then slot 0 and slot 1, each
``capacity`` bytes. A header is (magic, step, bytes, checksum of the slot's bytes, checksum of the header). A writer
first clears the header of the slot it is about to fill, then copies, then writes the header: a kill in the middle
of the copy leaves that slot without a valid header, and the other slot, which a writer never touches while it
holds the newest complete snapshot (``TakeSnapshot.keep``), still holds its step. A reader takes a slot only if its
header is valid and its bytes match the header's checksum, so a torn or corrupted record is never loaded.

The checksum is XXH3-64 (the ``xxhash`` package): it detects torn and flipped bytes as a CRC does, and it runs faster
than a single-threaded memory copy of the same bytes, so checking a record costs less than copying it (zlib's CRC-32
costs several copies; ``experiments.bench_snapshots`` measures the candidates side by side). Its streaming form
(``Checksum``) gives the same value as the one-shot one, so a writer checksums a record block by block as it copies,
while each block is still in cache.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

MAGIC = b"FTLABSN2"
_HEADER = struct.Struct("<8sqqQ")
_CHECKED = struct.Struct("<8sqqQQ")
HEADER_BYTES = 64
PAGE = 4096
SLOTS = 2
ROOT = Path("/dev/shm")
JOB_ROOT_NAME = re.compile(r"ftlab-\d+-[0-9a-f]+")
"""``job_root``'s names: the coordinator's pid and a random tag."""


Checksum = xxhash.xxh3_64
"""The checksum of a record's bytes, fed block by block (``update``, then ``intdigest``)."""


def checksum(data: bytes | memoryview) -> int:
    """The checksum of ``data`` in one call (equal to ``Checksum`` fed the same bytes in pieces)."""
    return xxhash.xxh3_64_intdigest(data)


class ChecksumError(RuntimeError):
    """A record's bytes do not match their checksum (torn or corrupted): they must not be loaded."""


@dataclass(frozen=True)
class Header:
    step: int
    nbytes: int
    checksum: int


def node_dir(root: str | Path, node: int) -> Path:
    return Path(root) / f"node-{node}"


def file_bytes(capacity: int) -> int:
    return PAGE + SLOTS * _round_up(capacity)


def slot_offset(slot: int, capacity: int) -> int:
    return PAGE + slot * _round_up(capacity)


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def encode_header(step: int, nbytes: int, digest: int) -> bytes:
    body = _HEADER.pack(MAGIC, step, nbytes, digest)
    return body + struct.pack("<Q", checksum(body))


def decode_header(raw: bytes | memoryview) -> Header | None:
    """The header in ``raw``, or None if the slot was never committed, was cleared, or the header is torn."""
    magic, step, nbytes, digest, check = _CHECKED.unpack_from(raw)
    if magic != MAGIC or checksum(raw[: _HEADER.size]) != check:
        return None
    return Header(step, nbytes, digest)


def headers(buffer: memoryview) -> list[Header | None]:
    return [decode_header(buffer[s * HEADER_BYTES : s * HEADER_BYTES + _CHECKED.size]) for s in range(SLOTS)]


def choose_slot(current: list[Header | None], keep: int) -> int:
    """The slot to overwrite: never the one holding step ``keep``; else an empty slot; else the older step."""
    candidates = [s for s in range(SLOTS) if current[s] is None or current[s].step != keep]  # type: ignore[union-attr]
    empty = [s for s in candidates if current[s] is None]
    if empty:
        return empty[0]
    return min(candidates, key=lambda s: current[s].step)  # type: ignore[union-attr]


def find_slot(buffer: memoryview, step: int) -> tuple[int, Header] | None:
    for slot, header in enumerate(headers(buffer)):
        if header is not None and header.step == step:
            return slot, header
    return None


def read_verified(buffer: memoryview, capacity: int, step: int, expected: int | None = None) -> memoryview:
    """The bytes of ``step``'s slot, after checking them against their header's checksum (and ``expected``)."""
    found = find_slot(buffer, step)
    if found is None:
        raise ChecksumError(f"no committed slot holds step {step}")
    slot, header = found
    offset = slot_offset(slot, capacity)
    data = buffer[offset : offset + header.nbytes]
    digest = checksum(data)
    if digest != header.checksum or (expected is not None and digest != expected):
        raise ChecksumError(f"the bytes of step {step} fail their checksum ({digest:#018x}, recorded "
                            f"{header.checksum:#018x}, expected {expected if expected is None else hex(expected)})")  # fmt: skip
    return data


def map_file(path: Path, capacity: int) -> mmap.mmap:
    """A record's whole file, mapped for reading with its pages populated in one call (``MAP_POPULATE``): faulting
    them in one by one costs more than copying their bytes. Shared and writable, so that tensors can view it without
    copying; readers never write."""
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), file_bytes(capacity), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def inventory(directory: Path, step: int) -> tuple[dict[str, int], list[str]]:
    """The records of ``step`` in a node's memory: {file name: checksum} of those whose bytes check out, and the names of
    those that do not (torn or corrupted)."""
    intact: dict[str, int] = {}
    corrupt: list[str] = []
    if not directory.is_dir():
        return intact, corrupt
    for path in sorted(directory.iterdir()):
        size = path.stat().st_size
        if size < file_bytes(1):
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                found = find_slot(view, step)
                if found is None:
                    continue
                read_verified(view, (size - PAGE) // SLOTS, step).release()
                intact[path.name] = found[1].checksum
            except ChecksumError:
                corrupt.append(path.name)
            finally:
                view.release()
    return intact, corrupt


def remove(directory: Path) -> None:
    """Remove a node's memory, and the job's directory with it once no node's memory is left in it."""
    shutil.rmtree(directory, ignore_errors=True)
    if directory.parent != ROOT and directory.parent.name.startswith("ftlab-"):
        try:
            directory.parent.rmdir()
        except OSError:
            pass  # another node's memory is still there (or the directory is gone already)


def claim(directory: Path) -> int:
    """Create a node's memory and hold it as long as this process lives: a shared lock on the directory, which the
    kernel drops when the process ends, SIGKILL included. A held memory is in use; one nobody holds is stale
    (``remove_stale``). Returns the descriptor that holds it (not inherited by the workers)."""
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # removed as stale (an empty job directory) between the two calls: make it again
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a cleaner holds it to remove it
        try:
            now = os.stat(directory)
            if (now.st_dev, now.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the directory locked was removed meanwhile: claim a new one


def remove_stale(root: Path = ROOT) -> list[Path]:
    """Remove this user's node memories that no live process holds (``claim``), and the job directories they
    leave empty. They are those of jobs killed outright, agents included (a SIGKILL to the job's whole process tree,
    the kernel's OOM killer), which nobody was left to free: without this they would hold the host's memory until
    it reboots. Returns the node memories removed."""
    removed = []
    for job in root.glob("ftlab-*"):
        if not JOB_ROOT_NAME.fullmatch(job.name):
            continue
        for node in job.glob("node-*"):
            try:
                fd = os.open(node, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue  # removed meanwhile, or not ours to read
            try:
                if os.fstat(fd).st_uid != os.getuid():
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its agent lives
            else:
                shutil.rmtree(node, ignore_errors=True)  # under the lock: a new claim waits, then finds it gone
                removed.append(node)
            finally:
                os.close(fd)
        try:
            job.rmdir()
        except OSError:
            pass  # a node's memory is still in it (or it is gone, or another user's)
    return removed


def job_root(tag: str) -> Path:
    """The directory of one job's node memories (each node agent owns ``node-N`` under it)."""
    return ROOT / f"ftlab-{tag}"


def open_file(path: Path, capacity: int) -> int:
    """A record's file, created and touched once (fresh pages are slow to write), else reused; its descriptor."""
    size = file_bytes(capacity)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if os.fstat(fd).st_size != size:
        try:
            os.ftruncate(fd, 0)  # a stale layout's file: start over
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError:  # memory full: claim nothing, so the next snapshot asks again (a sparse file would SIGBUS)
            os.ftruncate(fd, 0)
            os.close(fd)
            raise
    return fd
