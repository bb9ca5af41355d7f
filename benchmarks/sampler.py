"""A background thread that samples something every `period_s` until the `with` block ends."""

from __future__ import annotations

import threading


class Sampler:
    """Subclasses define `sample()`; it runs once at the start, then every `period_s`, and once more
    when the block ends (so a window's last moment is seen)."""

    period_s = 0.5

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                self.sample()
                return

    def sample(self) -> None:
        raise NotImplementedError
