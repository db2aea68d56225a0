"""The IPC plane's same-host doorbell: descriptors through a shared-memory ring.

On an H200 host one small engine message took ~0.2 ms one-way between busy
processes and ~0.4 ms after 1 ms idle (zmq's I/O threads on both
sides and the receiving loop are woken in turn), while a sequence number written
into shared memory and polled by the waiting loop arrived in 3-6 µs.
So the producer also *rings*: it writes each descriptor into a ring the consumer
polls while a ``recv_request`` waits, and writes one byte into a FIFO beside it
(``<ring>.wake``) that the consumer's event loop watches, so a consumer that stopped
spinning wakes at once instead of at its next timed poll. A lost, lapped or rejected
ring message costs latency, never correctness: the producer sends the descriptor
through the engine as well unless the consumer is known to read the ring, and then
still sends it if no release came in time (docs/ipc.md, "Doorbell").

Safety: the producer creates the file (``O_EXCL``, mode 0600, a random name under
``/dev/shm``) and names it, with a random 32-byte key, in the offer -- which
travels only over the authenticated engine session. The consumer reads it (``pread``,
read-only, never mapped: see :class:`BellReader`) and accepts a slot only when its
BLAKE2b MAC (keyed, over the sequence number and the payload) verifies, then decodes
the payload (the plane's fixed-layout record, ``Descriptor.from_ring``) with the
engine message's field rules. The producer unlinks the file once the consumer
acknowledged the offer (it mapped the ring before), so the name exists during one
request. The wake FIFO carries no data (a byte per message; one the consumer did not
drain is only a spurious wake-up), is made 0600 beside the ring and is unlinked with
it. A slot is ``seq u64 | length u32 | pad | mac 16 bytes | payload``; the writer
zeroes ``seq``, writes the rest, then ``seq`` (a seqlock: the reader re-reads ``seq``
after copying and the MAC catches anything torn).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
import os
import re
import secrets
import stat
import struct

__all__ = ["KEY_BYTES", "MAX_PAYLOAD", "SLOTS", "BellReader", "BellWriter", "valid_name"]

SLOTS = 64
SLOT_BYTES = 4096
SIZE = SLOTS * SLOT_BYTES
KEY_BYTES = 32
_HDR = struct.Struct("<QI4x16s")
_SEQ = struct.Struct("<Q")
#: the largest payload a slot carries (a descriptor of up to ~950 blocks); larger
#: descriptors go by the engine alone
MAX_PAYLOAD = SLOT_BYTES - _HDR.size
_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^aiokv-bell-[0-9a-f]{32}$")
_WAKE = ".wake"  # the wake FIFO's name: the ring's, plus this


def valid_name(name: str) -> bool:
    """Whether ``name`` is a ring name this module makes (no path, no other files)."""
    return bool(_NAME_RE.match(name))


def _mac(key: bytes, seq: int, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=16)
    h.update(_SEQ.pack(seq))
    h.update(payload)
    return h.digest()


class BellWriter:
    """The producer's ring for one consumer (creates the file; raises ``OSError``
    where there is no ``/dev/shm`` or it is full)."""

    def __init__(self) -> None:
        self.name = "aiokv-bell-" + secrets.token_hex(16)
        self.key = secrets.token_bytes(KEY_BYTES)
        self._path = os.path.join(_DIR, self.name)
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self._seq = 0
        self.closed = False
        self._wake = -1  # write end of the wake FIFO, once the consumer opened it
        try:
            os.mkfifo(self._path + _WAKE, 0o600)  # EEXIST for anything already there
        except OSError:
            self._mm.close()
            self.unlink()
            raise

    def open_wake(self) -> bool:
        """Open the wake FIFO's write end (non-blocking); False when no reader has it
        open (``ENXIO``: the consumer did not open it, e.g. an older one): the ring
        then works without wake-ups."""
        if self.closed or self._wake >= 0:
            return self._wake >= 0
        try:
            self._wake = os.open(
                self._path + _WAKE, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError:
            return False
        return True

    def post(self, payload: bytes) -> bool:
        """Write ``payload`` into the next slot; False (nothing written) if it is too
        large for a slot or the ring is closed."""
        if self.closed or len(payload) > MAX_PAYLOAD:
            return False
        self._seq += 1
        seq = self._seq
        off = ((seq - 1) % SLOTS) * SLOT_BYTES
        mm = self._mm
        _SEQ.pack_into(mm, off, 0)  # invalid while rewritten
        mm[off + _HDR.size : off + _HDR.size + len(payload)] = payload
        _HDR.pack_into(mm, off, 0, len(payload), _mac(self.key, seq, payload))
        _SEQ.pack_into(mm, off, seq)
        if self._wake >= 0:
            try:
                os.write(self._wake, b"\x01")
            except BlockingIOError:
                pass  # the FIFO is full: the reader has a wake-up pending anyway
            except OSError:  # the reader closed it (EPIPE): no more wake-ups
                os.close(self._wake)
                self._wake = -1
        return True

    def unlink(self) -> None:
        """Remove the names (the consumer's open files stay valid)."""
        for path in (self._path, self._path + _WAKE):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.unlink()
            self._mm.close()
            if self._wake >= 0:
                os.close(self._wake)
                self._wake = -1


class BellReader:
    """The consumer's read-only view of a producer's ring. Raises ``ValueError`` for a
    name or key this module would not make, ``OSError`` when the file cannot be
    opened or is not a ring (wrong type or size).

    The file is the producer's, so the reader trusts nothing about it: it opens it
    non-blocking (a FIFO of a valid name would otherwise block the loop in ``open``
    until a writer came) and reads it with ``pread``, not through a mapping (the
    producer may shrink the file at any time, and touching a mapping past the end of
    its file is SIGBUS: the consumer process would die). A short read is a slot not
    written yet."""

    def __init__(self, name: str, key: bytes) -> None:
        if not valid_name(name) or len(key) != KEY_BYTES:
            raise ValueError("not a doorbell name and key")
        fd = os.open(os.path.join(_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != SIZE:
                raise OSError(f"doorbell {name}: not a ring of {SIZE} bytes")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.key = key
        self.next = 1
        self.rejected = 0
        self.closed = False
        self.wake_fd = -1
        try:  # the wake FIFO, if the producer made one (non-blocking: never waits)
            w = os.open(
                os.path.join(_DIR, name + _WAKE),
                os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
            )
        except OSError:
            return
        if stat.S_ISFIFO(os.fstat(w).st_mode):
            self.wake_fd = w
        else:
            os.close(w)

    def drain_wake(self) -> bool:
        """Empty the wake FIFO (at most 64 KiB per call, so a flood cannot hold the
        loop); False when its writer is gone for good (end of file: the caller stops
        watching it and calls :meth:`close_wake`; the ring is then polled on the timer
        alone)."""
        if self.wake_fd < 0:
            return False
        for _ in range(16):
            try:
                got = os.read(self.wake_fd, 4096)
            except BlockingIOError:
                return True
            except OSError:
                got = b""
            if not got:  # every writer closed: end of file, readable for ever
                return False
            if len(got) < 4096:
                return True
        return True

    def close_wake(self) -> None:
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1

    def poll(self) -> list[bytes]:
        """The payloads posted since the last poll whose MAC verifies, in order. Slots
        the writer lapped are skipped (their messages still come by the engine), one
        being rewritten is left for the next poll, and one whose MAC fails is counted
        in ``rejected`` and skipped."""
        out: list[bytes] = []
        if self.closed:
            return out
        fd = self._fd
        for _ in range(2 * SLOTS):
            off = ((self.next - 1) % SLOTS) * SLOT_BYTES
            head = os.pread(fd, _HDR.size, off)
            if len(head) < _HDR.size:  # the file shrank: nothing there
                break
            seq, n, mac = _HDR.unpack(head)
            if seq < self.next:  # not written yet (or being rewritten: 0)
                break
            if n > MAX_PAYLOAD or (seq - self.next) % SLOTS:
                self.rejected += 1  # not a slot the writer makes
                self.next += 1
                continue
            payload = os.pread(fd, n, off + _HDR.size)
            again = os.pread(fd, _SEQ.size, off)
            if len(payload) < n or len(again) < _SEQ.size or _SEQ.unpack(again)[0] != seq:
                break  # rewritten (or cut) while read: next poll
            if not hmac.compare_digest(mac, _mac(self.key, seq, payload)):
                self.rejected += 1
                self.next += 1
                continue
            if seq > self.next:
                # lapped (a verified slot, so a real sequence number): the ring holds
                # seq - SLOTS + 1 .. seq at most; resume at the oldest of them (the
                # lost ones still come by the engine)
                self.next = seq - SLOTS + 1
                continue
            self.next = seq + 1
            out.append(payload)
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)
            self.close_wake()
