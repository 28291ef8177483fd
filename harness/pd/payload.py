"""What the prefill and decode rank payloads share: remote-callable access to their ledger."""

from __future__ import annotations

from typing import Any

from harness.ledger import LedgerWriter


class LedgerOwner:
    """Base of a rank payload that writes its accounting events to ``self.ledger``.

    The driver calls these through the rank's worker (``worker.call("ledger_events", since)``).
    """

    ledger: LedgerWriter

    def ledger_mark(self) -> int:
        """How many ledger events this worker has written."""
        return len(self.ledger.events)

    def ledger_events(self, since: int = 0) -> list[dict[str, Any]]:
        """This worker's ledger events from index ``since`` on, as JSON objects."""
        return [e.to_dict() for e in self.ledger.events[since:]]

    def close(self) -> None:
        self.ledger.close()
