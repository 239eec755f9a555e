"""Work queued by a long-running process, in that process: the review server's shot re-renders
in embedded mode (no broker). One thread works one batch at a time, as ``clipmill run --resume``
would (``embedded.run_batch``, then the assembly of the ads whose shots are in); a batch asked
for again while it is worked is worked once more afterwards, so nothing queued meanwhile is
left behind. The model is loaded on the first request and kept warm.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from clipmill.jobs.ads.assembly import assemble_batch
from clipmill.jobs.runner.embedded import run_batch
from clipmill.jobs.runner.stages import WorkerContext

log = logging.getLogger("clipmill.background")


class BackgroundRunner:
    def __init__(self, make_context: Callable[[], WorkerContext], group_size: int = 4):
        self._make_context = make_context
        self._ctx: WorkerContext | None = None
        self._group_size = group_size
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def submit(self, batch_id: str) -> None:
        """Work ``batch_id``'s queued jobs and assemble its ads, in the background."""
        with self._lock:
            if batch_id not in self._pending:
                self._pending.append(batch_id)
            self._idle.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="clipmill-background", daemon=True)
                self._thread.start()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending; False on timeout."""
        return self._idle.wait(timeout)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._idle.set()
                    return
                batch_id = self._pending.pop(0)
            try:
                if self._ctx is None:
                    self._ctx = self._make_context()
                run_batch(self._ctx, batch_id, self._group_size)
                assemble_batch(self._ctx, batch_id)
            except Exception as e:  # noqa: BLE001 - the jobs stay queued; say why, keep serving
                msg = f"batch {batch_id}: background work stopped ({e.__class__.__name__}: {e}); its jobs stay " \
                      f"queued (clipmill run --resume {batch_id} continues)"
                log.error(msg)
                self.errors.append(msg)
