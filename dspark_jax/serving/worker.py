"""The engine thread: the one owner of the `Scheduler` (and so of the compiled steps and caches).

HTTP handlers never touch the model. They `submit` a `Request` and receive `Update`s on an
asyncio queue of their event loop; `abort` (client gone) frees the slot. The thread sleeps on its
inbox while idle, otherwise it drains the inbox and runs one `Scheduler.step()` per iteration,
pushing each request's new tokens back. Every `stats_interval` seconds with new steps it logs an
`[MTP Stats]` line with the cumulative acceptance statistics.

Faults: a step that raises fails the requests it ran (the scheduler aborts them and rebuilds its
caches); the waiting ones stay queued. Anything else that raises on the thread ends the engine:
every request it holds, queued or running, gets an error `Update`, later `submit`s raise
`EngineStopped`, and `on_fatal` runs (the server then exits non-zero: its state is not trusted).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.errors import RequestError

log = logging.getLogger("dspark_jax.serving")


class QueueFull(RuntimeError):
    """More requests are waiting for a slot than the server accepts (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine thread has ended (stopped, or failed: `EngineWorker.error`); HTTP 503."""


@dataclass
class Update:
    """New tokens of one request; `finish_reason` and `stats` once it has finished; `error` if the
    engine failed it."""

    tokens: list[int]
    finish_reason: str | None = None
    stats: dict | None = None
    error: str | None = None


@dataclass(eq=False)
class Handle:
    request: Request
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    # tokens already pushed (engine thread only); 0 <=> still counted in the waiting queue
    sent: int = 0
    submitted: float = field(default_factory=time.monotonic)


def format_mtp_stats(stats: dict, extra: str = "") -> str:
    """One `[MTP Stats]` line (ATOM's periodic log line, our wording) from an mtp_stats dict."""
    if not stats["enabled"]:
        return "[MTP Stats] disabled (plain decoding)" + (f"; {extra}" if extra else "")
    dist = ", ".join(f"{k}:{v}" for k, v in stats["distribution"].items())
    lengths = ", ".join(f"{k}:{v}" for k, v in stats.get("verify_length_counts", {}).items() if v)
    line = (f"[MTP Stats] verify steps {stats['num_verify_steps']}, draft tokens {stats['total_draft_tokens']}, "
            f"accepted {stats['total_accepted_tokens']} ({100 * stats['acceptance_rate']:.2f}%), "
            f"tok/fwd {stats['average_tokens_per_forward']:.3f}, distribution {{{dist}}}, "
            f"steps by speculation length {{{lengths}}}")
    return f"{line}; {extra}" if extra else line


class EngineWorker:
    """Runs `scheduler` on a background thread. `max_queue`: requests allowed to wait for a slot
    (beyond it `submit` raises QueueFull). `on_finish(handle, update)` runs on the engine thread
    when a request ends (metrics); `on_fatal(error)` once if the thread dies of an error."""

    def __init__(self, scheduler: Scheduler, *, max_queue: int = 256, stats_interval: float = 10.0,
                 on_finish: Callable[[Handle, Update], None] | None = None,
                 on_first_token: Callable[[Handle], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.scheduler = scheduler
        self.max_queue = max_queue
        self.stats_interval = stats_interval
        self.on_finish, self.on_first_token, self.on_fatal = on_finish, on_first_token, on_fatal
        self._inbox: queue.Queue[tuple[str, Handle | None]] = queue.Queue()
        self._handles: dict[Request, Handle] = {}
        self._pending = 0                      # submitted, not yet in a slot
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = scheduler.stats.to_dict()  # snapshot, replaced after each step
        self._num_steps = 0
        self._stopped = False                  # the thread has ended or is ending (under _lock)
        self._step_started: float | None = None   # monotonic start of the step running now
        self.error: BaseException | None = None

    # -- called from HTTP handlers ------------------------------------------------------------
    def submit(self, req: Request, loop: asyncio.AbstractEventLoop) -> Handle:
        self.scheduler.check(req)
        handle = Handle(req, loop)
        with self._lock:                       # against the thread's death: nothing lands in a dead inbox
            if self._stopped:
                raise EngineStopped("the engine has stopped" + (f" after an error: {_describe(self.error)}"
                                                                if self.error is not None else ""))
            if self._pending >= self.max_queue:
                raise QueueFull(f"{self._pending} requests are already waiting for a slot "
                                f"(--max_queue_len={self.max_queue}); retry later")
            self._pending += 1
            self._inbox.put(("add", handle))
        return handle

    def abort(self, handle: Handle) -> None:
        self._inbox.put(("abort", handle))

    def stats(self) -> dict:
        return self._stats

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self._pending

    def step_running_for(self) -> float:
        """Seconds the step now running has taken so far (0 between steps): a watchdog's reading."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:             # the thread's last act: nobody may wait for ever
            log.exception("engine loop failed; failing every request and stopping the engine")
            self._die(e)
            return
        self._die(None)

    def _run(self) -> None:
        last_log, logged_steps = time.monotonic(), 0
        while not self._stop.is_set():
            self._drain(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self._step_started = time.monotonic()
                try:
                    touched = self.scheduler.step()
                except Exception as e:  # a failed step must not kill the server
                    log.exception("engine step failed; failing the requests it ran")
                    self._fail_stepped(f"engine error: {_describe(e)}")
                    continue
                finally:
                    self._step_started = None
                self._num_steps = self.scheduler.num_steps
                self._stats = self.scheduler.stats.to_dict()
                for req in touched:
                    self._push(req)
            now = time.monotonic()
            if now - last_log >= self.stats_interval:
                if self._num_steps != logged_steps:
                    log.info(format_mtp_stats(self._stats, f"engine steps {self._num_steps}, running "
                                                          f"{self.num_running}, waiting {self.num_waiting}"))
                    logged_steps = self._num_steps
                last_log = now

    def _die(self, error: BaseException | None) -> None:
        """End of the thread: refuse new requests, answer every one held or still in the inbox."""
        with self._lock:
            self._stopped, self.error = True, error
        message = (f"engine error: {_describe(error)}; the engine has stopped" if error is not None
                   else "the engine has stopped")
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._handles[handle.request] = handle
        for handle in self._handles.values():
            self._send(handle, Update([], error=message))
        self._handles.clear()
        if error is not None and self.on_fatal is not None:
            self.on_fatal(error)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=min(1.0, self.stats_interval)) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_inbox(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_inbox(self, kind: str, handle: Handle | None) -> None:
        if kind == "add":
            assert handle is not None
            try:
                self.scheduler.add(handle.request)
            except RequestError as e:          # validated at submit; kept for safety
                self._release_pending()
                self._send(handle, Update([], error=str(e)))
                return
            self._handles[handle.request] = handle
        elif kind == "abort":
            assert handle is not None
            req = handle.request
            if self._handles.pop(req, None) is not None:
                if handle.sent == 0:
                    self._release_pending()    # it was still waiting
                self.scheduler.abort(req)
                if self.on_finish is not None:
                    self.on_finish(handle, Update([], "abort", req.stats.to_dict() if req.stats else None))

    def _release_pending(self) -> None:
        with self._lock:
            self._pending -= 1

    def _push(self, req: Request) -> None:
        handle = self._handles.get(req)
        if handle is None:
            return
        if handle.sent == 0 and req.tokens:
            self._release_pending()            # admitted: it holds a slot now
            if self.on_first_token is not None:
                self.on_first_token(handle)
        update = Update(req.tokens[handle.sent:])
        handle.sent = len(req.tokens)
        if req.finish_reason is not None:
            update.finish_reason, update.stats = req.finish_reason, req.stats.to_dict()
            if self.on_finish is not None:
                self.on_finish(handle, update)
            del self._handles[req]             # after the callback: if it raises, the thread's end answers it
        self._send(handle, update)

    def _fail_stepped(self, message: str) -> None:
        """After a failed step: fail the requests the scheduler aborted (those it ran); the
        waiting ones stay queued for the next step."""
        for req, handle in list(self._handles.items()):
            if req.finish_reason is None:
                continue
            if handle.sent == 0:               # admitted by the failed step: no longer waiting
                self._release_pending()
            update = Update([], error=message)
            if self.on_finish is not None:
                self.on_finish(handle, update)
            del self._handles[req]
            self._send(handle, update)

    @staticmethod
    def _send(handle: Handle, update: Update) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.updates.put_nowait, update)
        except RuntimeError:                   # the handler's event loop is gone (shutdown)
            pass


def _describe(e: BaseException | None) -> str:
    return f"{type(e).__name__}: {e}"
