"""Server counters for ``GET /metrics``: requests, tokens, recent throughput (thread-safe)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque


class Metrics:
    """Counts what the engine did; ``snapshot`` is a JSON-ready dict.

    ``tokens_per_s`` is the rate of generated tokens over the last ``window`` seconds (or since
    start, if that is shorter)."""

    def __init__(self, window: float = 10.0, clock=time.monotonic):
        self.window, self.clock = window, clock
        self.start = clock()
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.received = self.admitted_requests = self.prompt_tokens = self.generated_tokens = 0
        self.prefill_groups = self.merged_groups = 0
        self.decode_steps = self.decode_rows = 0
        self.outcomes: Counter[str] = Counter()

    def queued(self, n: int) -> None:
        """``n`` requests entered the queue (negative: left it for the batch)."""
        with self._lock:
            self.received += max(n, 0)

    def admitted(self, n: int, prompt_tokens: int) -> None:
        """``n`` requests with ``prompt_tokens`` tokens in all were prefilled."""
        with self._lock:
            self.admitted_requests += n
            self.prompt_tokens += prompt_tokens

    def prefilled(self, merged: bool) -> None:
        """A group of admitted requests was prefilled: in a decode step's forward (``merged``) or a forward of its own."""
        with self._lock:
            self.prefill_groups += 1
            self.merged_groups += merged

    def stepped(self, rows: int) -> None:
        """A decode step ran with ``rows`` running rows (newcomers merged into it not counted)."""
        with self._lock:
            self.decode_steps += 1
            self.decode_rows += rows

    def generated(self, n: int) -> None:
        """A step produced ``n`` tokens."""
        now = self.clock()
        with self._lock:
            self.generated_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def finished(self, reason: str) -> None:
        """A request ended (``stop``, ``length``, ``cancelled`` or ``error``)."""
        with self._lock:
            self.outcomes[reason] += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()

    def snapshot(self) -> dict:
        """Counters and the recent token rate."""
        now = self.clock()
        with self._lock:
            self._trim(now)
            span = min(self.window, now - self.start)
            recent = sum(n for _, n in self._recent)
            return {"uptime_s": round(now - self.start, 3), "requests_received": self.received,
                    "requests_finished": sum(self.outcomes.values()),
                    "requests_cancelled": self.outcomes["cancelled"], "requests_failed": self.outcomes["error"],
                    "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                    "prefill_groups": self.prefill_groups, "prefill_groups_merged": self.merged_groups,
                    "decode_steps": self.decode_steps, "decode_rows": self.decode_rows,
                    "tokens_per_s": round(recent / span, 3) if span > 0 else 0.0}
