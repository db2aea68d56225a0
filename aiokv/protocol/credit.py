"""Protocol v2 admission: standing credit, both ends, without I/O.

Version 1 asked for room per transfer (RESERVE -> GRANT -> DATA -> DONE: two
round trips before the data is acknowledged). Version 2 keeps the rule "no
data on the wire without room" but moves the asking off the critical path:
the receiver grants each session a *window* in advance — bytes and a tensor
count, both reserved in its receive budget — and tops it up as the session's
tensors are collected. The sender spends credit locally and sends one message
(PUT header + tensor frames); the receiver answers with coalesced ACKs that
carry new credit, the landed transfers and the refused ones.

Two ledgers, one per end:

=======================  =============================================
:class:`CreditLedger`    receiver, per session: credit outstanding, bytes
                         held (landed, not collected), what to top up
:class:`CreditAccount`   sender, per session: credit to spend, window
=======================  =============================================

Invariants (tested in ``tests/test_credit.py``):

* receiver: ``credit <= window`` for bytes and tensors, always; credit is
  reserved in the receive budget, so credit + everything held stays within it;
* a PUT that spends more than the credit the receiver granted is a protocol
  error (the sender is broken or hostile), never a silent overcommit;
* sender: credit never negative; it spends only after the window is known.

Credit refills as a session's PUTs land (the ACK carries both), as far as the
budget has room. When room is short, it goes first to the sessions that hold
the least (credit + landed, uncollected bytes): a consumer that collects peer
A's tensors first gets A's next ones even while peer B's fill the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from .codec import WireError

__all__ = ["CreditAccount", "CreditLedger"]


@dataclass(slots=True)
class CreditLedger:
    """The receiver's ledger of one session's standing credit."""

    window_bytes: int
    window_tensors: int
    credit_bytes: int = 0  # granted, not yet spent by the sender
    credit_tensors: int = 0
    held_bytes: int = 0  # landed on credit, not yet collected
    held_tensors: int = 0
    announced: bool = False  # the window was told to the sender
    paused_for: int = 0  # the sender returned its credit for this RESERVE: none until it ends

    def spend(self, nbytes: int, ntensors: int) -> None:
        """A PUT arrived: take its size from the credit. Overspending is an error."""
        if nbytes > self.credit_bytes or ntensors > self.credit_tensors:
            raise WireError(
                "over_credit",
                f"PUT of {nbytes} bytes / {ntensors} tensors over the credit granted "
                f"({self.credit_bytes} bytes / {self.credit_tensors} tensors)",
            )
        self.credit_bytes -= nbytes
        self.credit_tensors -= ntensors

    def hold(self, nbytes: int, ntensors: int) -> None:
        """Spent credit that landed: it is held until collected."""
        self.held_bytes += nbytes
        self.held_tensors += ntensors

    def give_back(self, nbytes: int, ntensors: int) -> None:
        """The sender returned unspent credit (RETURN); more than it holds is an error."""
        if nbytes > self.credit_bytes or ntensors > self.credit_tensors:
            raise WireError("over_credit", "RETURN of more credit than was granted")
        self.credit_bytes -= nbytes
        self.credit_tensors -= ntensors

    def release(self, nbytes: int, ntensors: int) -> None:
        """Held tensors left the store (collected, expired, discarded)."""
        self.held_bytes = max(0, self.held_bytes - nbytes)
        self.held_tensors = max(0, self.held_tensors - ntensors)

    def want(self) -> tuple[int, int]:
        """How much credit would refill the window now (bytes, tensors)."""
        return (self.window_bytes - self.credit_bytes, self.window_tensors - self.credit_tensors)

    @property
    def share(self) -> int:
        """Bytes of the receive budget this session occupies (credit + held): refills go
        to the sessions with the smallest share first."""
        return self.credit_bytes + self.held_bytes

    def top_up(self, room: int, room_tensors: int) -> tuple[int, int]:
        """New credit to send, at most ``room`` bytes and ``room_tensors`` tensors (the
        budget left); (0, 0) if none.

        Always refills as far as the room allows: the sender cannot say how much its
        next transfer needs, so any shortfall left standing could stall it for good.
        (Batching comes from the caller: one top-up per loop pass, not per transfer.)
        """
        wb, wt = self.want()
        add_b = max(0, min(wb, room))
        add_t = max(0, min(wt, room_tensors))
        self.credit_bytes += add_b
        self.credit_tensors += add_t
        return (add_b, add_t)

    @property
    def short(self) -> bool:
        """The window is not full: more credit is due as soon as the budget has room."""
        wb, wt = self.want()
        return wb > 0 or wt > 0


@dataclass(slots=True)
class CreditAccount:
    """The sender's view of its credit with one receiver."""

    window_bytes: int = 0
    window_tensors: int = 0
    credit_bytes: int = 0
    credit_tensors: int = 0

    def fits_window(self, nbytes: int, ntensors: int) -> bool:
        """Can this transfer ever go on credit (else it takes the RESERVE path)?"""
        return 0 < ntensors <= self.window_tensors and nbytes <= self.window_bytes

    def try_spend(self, nbytes: int, ntensors: int) -> bool:
        if nbytes > self.credit_bytes or ntensors > self.credit_tensors:
            return False
        self.credit_bytes -= nbytes
        self.credit_tensors -= ntensors
        return True

    def take_all(self) -> tuple[int, int]:
        """Give up all unspent credit (to send back in a RETURN)."""
        out = (self.credit_bytes, self.credit_tensors)
        self.credit_bytes = self.credit_tensors = 0
        return out

    def add(self, window_bytes: int, window_tensors: int, nbytes: int, ntensors: int) -> None:
        """Apply an ACK's window and new credit; a receiver may not exceed its window."""
        if nbytes > window_bytes or ntensors > window_tensors:
            raise WireError("bad_field", "ACK grants more credit than its window")
        self.window_bytes = window_bytes
        self.window_tensors = window_tensors
        self.credit_bytes = min(self.credit_bytes + nbytes, window_bytes)
        self.credit_tensors = min(self.credit_tensors + ntensors, window_tensors)
