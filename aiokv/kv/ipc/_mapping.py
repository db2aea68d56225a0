"""The IPC plane's consumer side below the request flow: the abort words every copy
checks (:class:`AbortWords`) and a producer's export mapped and verified
(:class:`Mapper`). See docs/ipc.md, "Export, map, verify" and "Abort word"."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aiokv._runtime.threads import start_daemon

from ..._exceptions import IpcUnavailableError
from ..layouts import KVLayout
from . import _doorbell, _kernel
from ._wire import _PROBE_SEGMENTS, ABORT_WORDS, Descriptor, Offer, PushOffer, probe_pattern

__all__ = ["ABORT_WORDS", "AbortWords", "Mapper", "seg_bytes"]

log = logging.getLogger("aiokv.kv.ipc")


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists here (another user's counts; 0 or less: no)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def seg_bytes(layout: KVLayout) -> int:
    """Bytes of one contiguous segment of a block (the kernel's unit)."""
    return layout.segment_numel() * layout.itemsize


@dataclass(slots=True, eq=False)
class _Mapping:
    """A verified import of one producer export (consumer side)."""

    token: int
    layout: KVLayout
    storages: list[torch.Tensor]
    src_layers: list[torch.Tensor]  # per-layer word-typed views (torch path)
    src_table: torch.Tensor  # int64 base addresses (Triton path)
    word: int
    stream: Any
    align: int = 1  # bytes dividing every base address of both sides (vector width bound)
    events: dict[int, tuple[bytes, Any]] = field(default_factory=dict)
    inflight: int = 0
    broken: str = ""
    # the producer's process, when this process could see it at mapping time (same PID
    # namespace): once it is gone the mapping only keeps its memory allocated
    pid: int = 0
    # layer-wise: the tables of layers [lo, hi), each its own (16-byte aligned)
    # allocation, never freed while the mapping lives: a slice of src_table at an odd
    # layer would be only 8-byte aligned, and Triton would compile (and load) another
    # variant of the kernel in the middle of a request
    tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    bell: _doorbell.BellReader | None = None  # the producer's doorbell ring, if any
    raw: _kernel.RawLaunch | None = None  # the copy through cuLaunchKernel, verified
    reply_to: str = ""  # the producer's engine (a ring message counts as from it)
    # ring records read before their request waited (request id -> the descriptor),
    # oldest first, at most the plane's limit: a late recv_request takes its own from here
    # (and whether the producer sent it by the ring alone: solo)
    pending: dict[str, tuple[Descriptor, bool]] = field(default_factory=dict)
    # push mode (a producer's mapping of a consumer's export): the mapped layers are the
    # copy's destination, this side's cache its source; the consumer's abort blocks
    # mapped so far (block number -> int32 view) and the grant-answering state
    push: bool = False
    aborts: dict[int, torch.Tensor] = field(default_factory=dict)
    # push mode, a consumer's mapping of a producer's export: the producer said it has
    # mapped our export (its last descriptor); we sent it ours; the blocks of our abort
    # words it has shown it maps (a push with a slot in them), so grants name the rest
    can_push: bool = False
    push_offered: bool = False
    told: set[int] = field(default_factory=set)
    grant_bell: _doorbell.BellWriter | None = None  # our grants' ring to this producer
    grant_bell_unlinked: bool = False
    # push mode, the producer's side: grants read from the consumer's ring and not used
    # yet (request id -> grant), and request ids it answered by pull whose grant may
    # still come by the ring (void: dropped when it does); both oldest first, bounded
    grants: dict[str, Any] = field(default_factory=dict)
    pulled: dict[str, None] = field(default_factory=dict)
    # push mode, the consumer's side: grants the producer answered it never used (a
    # revoke's answer: grant id -> request id), oldest first, bounded
    revoked: dict[int, str] = field(default_factory=dict)


def abort_view(t: torch.Tensor) -> torch.Tensor:
    """A mapped abort block (bytes) as its :data:`ABORT_WORDS` int32 words."""
    if t.numel() < 4 * ABORT_WORDS:
        raise IpcUnavailableError("map_size", "abort block smaller than announced")
    return t[: 4 * ABORT_WORDS].view(torch.int32)


class AbortWords:
    """The consumer's abort words: int32 words in device memory, in blocks of
    :data:`ABORT_WORDS`, never freed. A slot is a global number g -- word
    ``g % ABORT_WORDS`` of block ``g // ABORT_WORDS`` -- handed out until its word is
    set (then never again), and set from a control stream of its own by a copy."""

    def __init__(self, device: torch.device, backend: Any) -> None:
        self.device = device
        self.backend = backend
        self.blocks: dict[int, torch.Tensor] = {}
        self._next = 0
        self.free: list[int] = []  # slots whose words were never set
        self._one: torch.Tensor | None = None  # pinned int32 1: the abort words' source
        self._zeros: torch.Tensor | None = None  # pinned int32 0s: a new block's
        self._stream: Any = None
        self.exports: dict[int, Any] = {}  # block -> its export (push mode)

    def prepare(self) -> None:
        """On a daemon thread, once, before the first mapping: the control stream, the
        pinned sources of the abort words' copies, and the first block of abort words
        (the first CUDA work of a consumer may take a while: 0.2-0.4 s, which would
        stall the loop). Later blocks (every 4096 requests) are made on
        the loop, one small copy each."""
        with torch.cuda.device(self.device):
            self.ctl()
            self._pinned_one()
            self.block(0)

    def block(self, block: int) -> torch.Tensor:
        t = self.blocks.get(block)
        if t is None:
            if self.device.type == "cuda":
                # Zeroed on the control stream (where the words are later set) and waited
                # for: a zero-fill left queued on the caller's stream could otherwise run
                # after an abort and clear it (an aborted probe
                # launch was caught writing that way). Zeroed by a copy from pinned memory, not a kernel (see
                # _set_abort). A 16 KiB copy once per 4096 requests.
                ctl = self.ctl()
                if self._zeros is None:
                    self._zeros = torch.zeros(ABORT_WORDS, dtype=torch.int32).pin_memory()
                with torch.cuda.stream(ctl):
                    t = torch.empty(ABORT_WORDS, dtype=torch.int32, device=self.device)
                    t.copy_(self._zeros, non_blocking=True)
                ctl.synchronize()
            else:
                t = torch.zeros(ABORT_WORDS, dtype=torch.int32, device=self.device)
            # never freed: a launch stuck behind a dead producer's event may read its
            # word whenever (if ever) that event fires
            self.blocks[block] = t
        return t

    def export(self, block: int) -> Any:
        """Block ``block``'s export (push mode: the producer's kernel reads the words)."""
        e = self.exports.get(block)
        if e is None:
            e = self.exports[block] = self.backend.export(self.block(block).untyped_storage())
        return e

    def landed(self) -> Any:
        """An event recorded on the control stream now: fired once every abort word set
        so far is written (an always-fired stand-in on CPU)."""
        if self.device.type != "cuda":
            return _Landed()
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self.ctl())
        return ev

    def ctl(self) -> Any:
        if self._stream is None:
            self._stream = self.backend.new_stream(self.device)
        return self._stream

    def slot(self) -> int:
        """A slot whose abort word was never set (aborted words are never reused)."""
        if self.free:
            return self.free.pop()
        g = self._next
        self._next += 1
        self.block(g // ABORT_WORDS)  # made (and zeroed) before any launch uses it
        return g

    def word(self, g: int) -> tuple[torch.Tensor, int]:
        """Slot ``g``'s abort word: its block and index."""
        return self.blocks[g // ABORT_WORDS], g % ABORT_WORDS

    def set(self, g: int) -> None:
        """Set slot ``g``'s abort word, from the control stream, with a copy (a DMA from
        pinned host memory), not a kernel: an abort must never be a kernel's first
        launch in the process -- under lazy module loading that waits until the device
        is idle, i.e. behind the very copy it aborts when that one waits on a peer's
        event (torch's fill picks a kernel by the word's alignment, and the
        one for 8-byte-aligned words had not been loaded yet)."""
        ab, slot = self.word(g)
        if ab.device.type == "cuda":
            with torch.cuda.stream(self.ctl()):
                ab[slot : slot + 1].copy_(self._pinned_one(), non_blocking=True)
        else:
            ab[slot] = 1

    def _pinned_one(self) -> torch.Tensor:
        """The abort copies' source: a pinned int32 1 (made once, never written)."""
        if self._one is None:
            self._one = torch.ones(1, dtype=torch.int32).pin_memory()
        return self._one


class _Landed:
    def query(self) -> bool:
        return True


class Mapper:
    """Maps and verifies producers' exports for one consumer (its device, layout and
    caches): :meth:`map_verified`, on a daemon thread. With ``warm`` it compiles the
    copy kernel for the consumer's own geometry at once, on a thread of its own."""

    def __init__(
        self,
        device: torch.device,
        layout: KVLayout,
        caches: Any,
        backend: Any,
        options: Any,
        drv: Any,
        words: AbortWords,
        *,
        warm: bool,
    ) -> None:
        self.device = device
        self.layout = layout
        self.caches = caches
        self.backend = backend
        self.options = options
        self._drv = drv
        self.words = words
        # the copy kernel compiled ahead for this side's own geometry, off the loop (the
        # first mapping's verification otherwise compiles it: seconds in a fresh process)
        self._warming = (
            start_daemon(self._warm_kernel, "aiokv-ipc-warm")
            if warm and self.use_triton()
            else None
        )

    def map_verified(self, offer: Offer, layout: KVLayout, slots: list[int]) -> _Mapping:
        """On a daemon thread: map the export's storages and probe, build the mapping
        and verify it (:meth:`_open`). Nothing here may block the event loop, and the
        loop never waits for this thread while holding anything it needs: the
        verification's first launches (the kernel, torch's fills and compares) may,
        under CUDA's lazy module loading, wait for an idle device -- e.g. behind a
        ``gpu_wait`` copy stuck on a dead producer's event; then this mapping hangs
        (its requests fall back with ``map_timeout``), not the loop. The loop's own
        abort words are set by copies, never by a kernel's first launch."""
        dev = self.device
        if self._warming is not None:  # one compile at a time (its errors are logged)
            with contextlib.suppress(Exception):
                self._warming.result()
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            storages = [self.backend.open(e, dev) for e in offer.storages]
            probe = self.backend.open(offer.probe, dev)
            return self._open(offer, layout, slots, storages, probe)

    def map_push(self, po: PushOffer, layout: KVLayout, slots: list[int]) -> _Mapping:
        """On a daemon thread (producer, push mode): map a consumer's export -- its cache,
        probe, verification target and first abort block -- and verify it: the probe
        reads back as the consumer's pattern (it is that consumer's memory), and the
        copy kernel, launched as a push launches it, writes the pattern into the target
        (read back here) and writes nothing with its abort word set (``slots``: this
        side's own abort slots for those probe copies). Needs the Triton kernel."""
        dev = self.device
        if not self.use_triton() and dev.type == "cuda":
            raise IpcUnavailableError("push_needs_triton")
        if self._warming is not None:
            with contextlib.suppress(Exception):
                self._warming.result()
        offer = po.offer
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            storages = [self.backend.open(e, dev) for e in offer.storages]
            probe = self.backend.open(offer.probe, dev)
            target = self.backend.open(po.target, dev)
            abort0 = self.backend.open(po.abort0, dev)
            m = self._build(offer, layout, storages)
            m.push = True
            m.aborts[0] = abort_view(abort0)
            self._verify_push(m, offer, slots, probe, target)
            return m

    def map_abort_block(self, e: Any) -> torch.Tensor:
        """On a daemon thread (producer, push mode): map one more of a consumer's abort
        blocks (as its int32 words)."""
        dev = self.device
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            return abort_view(self.backend.open(e, dev))

    def _verify_push(
        self,
        m: _Mapping,
        offer: Offer,
        slots: list[int],
        probe: torch.Tensor,
        target: torch.Tensor,
    ) -> None:
        dev = self.device
        seg = seg_bytes(self.layout)
        nbytes = _PROBE_SEGMENTS * seg
        if probe.numel() < nbytes or target.numel() < nbytes:
            raise IpcUnavailableError("map_size", "probe or target smaller than announced")
        want = probe_pattern(offer.nonce, nbytes, dev)
        if not torch.equal(probe[:nbytes], want):  # the consumer's memory, as it said
            raise IpcUnavailableError("verify_failed", "the consumer's probe did not read back")
        wdt = _kernel.WORDS[m.word]
        tgt = target[:nbytes]
        tgt.zero_()
        expect = want.view(_PROBE_SEGMENTS, -1).flip(0).reshape(-1)
        swap = torch.tensor([[1, 0], [0, 1]], dtype=torch.int64, device=dev)
        if dev.type != "cuda":  # (the CPU tests' fake: the torch copy)
            s2, d2 = want.view(_PROBE_SEGMENTS, -1), tgt.view(_PROBE_SEGMENTS, -1)
            _kernel.torch_pair_copy([s2], [d2], 0, swap[0], swap[1])
            if not torch.equal(tgt, expect):
                raise IpcUnavailableError("verify_failed", "the push probe did not land")
            return
        untouched = torch.zeros(nbytes, dtype=torch.uint8, device=dev)

        def jit(st: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, s: int) -> Any:
            ok = _kernel.launch_pair_copy(st, dt, swap, a, s, **self._probe_geometry(m))
            if not ok:
                raise IpcUnavailableError("grid_too_big")
            return ok

        src = want.view(wdt)
        compiled = self._probe_copies(m, src, (tgt.view(wdt), untouched.view(wdt)), slots[:2], jit)
        if not torch.equal(tgt, expect):
            raise IpcUnavailableError("verify_failed", "the push probe did not land")
        if bool(untouched.any()):
            raise IpcUnavailableError("verify_failed", "a launch with its abort word set wrote")
        if self._drv is not None and compiled is not None and compiled is not True:
            m.raw = self._try_raw(m, compiled, src, swap, expect, slots[2:])

    def _warm_kernel(self) -> None:
        """On a daemon thread at start: compile (not launch) the copy kernel for a
        producer of this side's own layout and allocation -- the usual pairing -- so
        that the first mapping's verification finds it compiled. Another geometry (a
        producer with another ``num_blocks`` or alignment) compiles at its mapping, as
        before. Failures are logged; the verification then compiles."""
        try:
            mine = self.caches
            seg = seg_bytes(self.layout)
            stride = self.layout.num_blocks * seg
            word = _kernel.word_size(mine.max_word(), seg, stride)
            align = _kernel.base_alignment(*(t.data_ptr() for t in mine.tensors))
            t0 = time.perf_counter()
            with torch.cuda.device(self.device):
                _kernel.warm_pair_copy(
                    self.device,
                    word=word,
                    seg_words=seg // word,
                    src_part_stride=stride // word,
                    dst_part_stride=stride // word,
                    block_stride=seg // word,
                    base_align=align,
                )
            log.debug("aiokv IPC plane: copy kernel compiled in %.3f s", time.perf_counter() - t0)
        except Exception as exc:
            log.info("aiokv IPC plane: compiling the copy kernel ahead failed: %r", exc)

    def use_triton(self) -> bool:
        return self.device.type == "cuda" and not self.options.force_torch and (_kernel.available())

    def geometry(
        self, m: _Mapping, *, n_pairs: int, n_layers: int, parts: int
    ) -> _kernel.CopyGeometry:
        """The copy kernel's geometry arguments for mapping ``m`` (in ``m``'s words)."""
        seg = seg_bytes(self.layout)
        w = m.word
        theirs, mine = m.layout.num_blocks * seg // w, self.layout.num_blocks * seg // w
        return {
            "n_pairs": n_pairs,
            "word": w,
            "n_layers": n_layers,
            "parts": parts,
            "seg_words": seg // w,
            "src_part_stride": mine if m.push else theirs,
            "dst_part_stride": theirs if m.push else mine,
            "block_stride": seg // w,
            "base_align": m.align,
        }

    def _open(
        self,
        offer: Offer,
        layout: KVLayout,
        slots: list[int],
        storages: list[torch.Tensor],
        probe: torch.Tensor,
    ) -> _Mapping:
        """Check the mapped storages, build the mapping and verify it (``slots``: four
        abort slots for the probe copies, when the Triton kernel is used)."""
        m = self._build(offer, layout, storages)
        m.pid = offer.pid if _pid_alive(offer.pid) else 0  # (0: not ours to watch)
        self._verify(m, offer, slots, probe)
        return m

    def _build(self, offer: Offer, layout: KVLayout, storages: list[torch.Tensor]) -> _Mapping:
        """The mapping of an export's mapped storages (sizes checked; not verified)."""
        dev = self.device
        for e, s in zip(offer.storages, storages, strict=True):
            if s.numel() != e.size:
                raise IpcUnavailableError("map_size", f"mapped {s.numel()} of {e.size} bytes")
        mine = self.caches
        word = min(offer.word, mine.max_word())
        seg = seg_bytes(self.layout)
        word = _kernel.word_size(word, seg, layout.num_blocks * seg, self.layout.num_blocks * seg)
        wdt = _kernel.WORDS[word]
        need = layout.layer_nbytes()
        src_layers = []
        for si, off in offer.layers:
            flat = storages[si][off : off + need]
            v = flat.view(wdt)
            shape = list(layout.layer_shape())
            shape[-1] = shape[-1] * layout.itemsize // word
            src_layers.append(v.view(shape))
        table = torch.tensor([t.data_ptr() for t in src_layers], dtype=torch.int64).to(dev)
        stream = self.backend.new_stream(dev) if dev.type == "cuda" else None
        align = _kernel.base_alignment(
            *(t.data_ptr() for t in src_layers), *(t.data_ptr() for t in mine.tensors)
        )
        m = _Mapping(offer.token, layout, storages, src_layers, table, word, stream, align)
        m.pid = offer.pid if _pid_alive(offer.pid) else 0  # (0: not ours to watch)
        return m

    def _verify(self, m: _Mapping, offer: Offer, slots: list[int], probe: torch.Tensor) -> None:
        """Copy the producer's probe with the real kernel (and once with the abort word
        set) and compare with the pattern; also loads the kernel before any copy can
        wait on a peer's event (lazy module loading)."""
        dev = self.device
        seg = seg_bytes(self.layout)
        if probe.numel() < _PROBE_SEGMENTS * seg:
            raise IpcUnavailableError("map_size", "probe smaller than announced")
        want = probe_pattern(offer.nonce, _PROBE_SEGMENTS * seg, dev)
        w = m.word
        wdt = _kernel.WORDS[w]
        src = probe[: _PROBE_SEGMENTS * seg].view(wdt)
        out = torch.zeros(_PROBE_SEGMENTS * seg, dtype=torch.uint8, device=dev)
        untouched = torch.zeros_like(out)
        dst = out.view(wdt)
        swap = torch.tensor([[1, 0], [0, 1]], dtype=torch.int64, device=dev)
        compiled: Any = None
        if self.use_triton():

            def jit(st: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, s: int) -> Any:
                ok = _kernel.launch_pair_copy(st, dt, swap, a, s, **self._probe_geometry(m))
                if not ok:
                    raise IpcUnavailableError("grid_too_big")
                return ok

            compiled = self._probe_copies(m, src, (dst, untouched.view(wdt)), slots[:2], jit)
        else:
            s2 = src.view(_PROBE_SEGMENTS, -1)
            d2 = dst.view(_PROBE_SEGMENTS, -1)
            _kernel.torch_pair_copy([s2], [d2], 0, swap[0], swap[1])
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
        expect = want.view(_PROBE_SEGMENTS, -1).flip(0).reshape(-1)
        if not torch.equal(out, expect):
            raise IpcUnavailableError("verify_failed", "the mapped probe did not read back")
        if self.use_triton() and bool(untouched.any()):
            raise IpcUnavailableError("verify_failed", "a launch with its abort word set wrote")
        if self._drv is not None and compiled is not None and compiled is not True:
            m.raw = self._try_raw(m, compiled, src, swap, expect, slots[2:])
        del probe

    def _probe_geometry(self, m: _Mapping) -> _kernel.CopyGeometry:
        return self.geometry(m, n_pairs=_PROBE_SEGMENTS, n_layers=1, parts=1)

    def _probe_copies(
        self,
        m: _Mapping,
        src: torch.Tensor,
        targets: Sequence[torch.Tensor],
        slots: list[int],
        launch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Any],
    ) -> Any:
        """The probe copies of a verification on ``m``'s stream, waited for: ``src`` into
        ``targets[0]`` with slot ``slots[0]``, and into ``targets[1]`` with slot
        ``slots[1]``, whose abort word is set first (that copy must write nothing).
        ``launch(src table, dst table, abort block, word)`` launches one; what the first
        returned is returned."""
        dev = self.device
        self.words.set(slots[1])
        stream = m.stream
        # after the targets' zero-fills (caller's stream) and the abort (control stream)
        stream.wait_stream(torch.cuda.current_stream(dev))
        stream.wait_stream(self.words.ctl())
        first: Any = None
        with torch.cuda.stream(stream):  # (the tables, too, live on this stream)
            for target, g in zip(targets, slots[:2], strict=True):
                a, s = self.words.word(g)
                # separate (aligned) tables: the same specialisation as the real copies
                st = torch.tensor([src.data_ptr()], dtype=torch.int64).to(dev)
                dt = torch.tensor([target.data_ptr()], dtype=torch.int64).to(dev)
                r = launch(st, dt, a, s)
                first = r if first is None else first
        stream.synchronize()  # once per export, on the mapping's thread (not the loop)
        return first

    def _try_raw(
        self,
        m: _Mapping,
        compiled: Any,
        src: torch.Tensor,
        swap: torch.Tensor,
        want: torch.Tensor,
        slots: list[int],
    ) -> _kernel.RawLaunch | None:
        """The verified kernel through :class:`~aiokv.kv.ipc._kernel.RawLaunch`: the same
        probe copy (bit-exact) and abort check (writes nothing) through the driver, or
        None (any error or difference: requests then launch through Triton)."""
        dev = self.device
        seg = seg_bytes(self.layout)
        assert self._drv is not None
        try:
            rl = _kernel.RawLaunch(compiled, self._drv)
            outs = [torch.zeros(_PROBE_SEGMENTS * seg, dtype=torch.uint8, device=dev)
                    for _ in range(2)]  # fmt: skip

            def raw(st: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, s: int) -> None:
                programs, args = _kernel.pair_copy_args(
                    st.data_ptr(), dt.data_ptr(), swap.data_ptr(), a.data_ptr(), dev, s,
                    **self._probe_geometry(m),
                )  # fmt: skip
                rl.launch(programs, m.stream.cuda_stream, args)

            self._probe_copies(m, src, outs, slots, raw)
            ok = torch.equal(outs[0], want) and not bool(outs[1].any())
        except Exception as exc:  # a Triton whose kernels this cannot launch
            log.info(
                "aiokv IPC plane: copies launch through Triton (%s: %s)", type(exc).__name__, exc
            )
            return None
        if not ok:
            log.warning("aiokv IPC plane: the driver launch of the copy differed; Triton launches")
            return None
        return rl
