"""Peak resident memory per method when all methods share one process.

Every method runs in the benchmark's process (interleaving needs that), so the process-wide peak
(`ru_maxrss`) cannot be split by method. Instead a daemon thread samples this process's RSS every
`interval_s` while a generation runs:
- `peak_rss` is the largest RSS seen during that method's generations: the target, every loaded
  drafter and the method's working memory (KV caches, tree buffers, logits) all included;
- `growth` is that peak minus the RSS just before the generation started: the transient memory
  the method itself needed (caches and activations), the number that differs between methods.
Both are sampled values: a spike shorter than the interval can be missed. Drafter weights are
loaded before the runs start, so they show up in `peak_rss` of every method, not in `growth`.
"""

from __future__ import annotations

import threading

import psutil


class RssMonitor:
    """Samples this process's RSS in the background between `begin()` and `end()`."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.process = psutil.Process()
        self.interval_s = interval_s
        self.active = threading.Event()
        self.stopped = threading.Event()
        self.start_rss = 0
        self.peak = 0
        self.thread = threading.Thread(target=self._sample, name="moaspec-rss", daemon=True)
        self.thread.start()

    def begin(self) -> None:
        self.start_rss = self.peak = self.process.memory_info().rss
        self.active.set()

    def end(self) -> tuple[int, int]:
        """-> (peak RSS bytes, growth bytes) since `begin()`."""
        self.active.clear()
        self.peak = max(self.peak, self.process.memory_info().rss)
        return self.peak, self.peak - self.start_rss

    def close(self) -> None:
        self.stopped.set()
        self.active.set()  # wake the thread so it can exit
        self.thread.join(timeout=1.0)

    def _sample(self) -> None:
        while not self.stopped.is_set():
            self.active.wait()
            if self.stopped.is_set():
                return
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.stopped.wait(self.interval_s)
