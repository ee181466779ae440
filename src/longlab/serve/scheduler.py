"""One background thread that owns the :class:`~longlab.engine.Engine` and drives ``step()``.

HTTP handlers hand it :class:`Ticket` objects; the thread checks each (tokens, size against the model and
memory: :meth:`Engine.check`), queues it, and admits the queue's head into the engine between steps when

- fewer than ``max_batch`` requests run, and
- the KV bytes the running requests hold (:meth:`Engine.held_bytes`, spare slots and batch padding
  included) plus the head's estimate fit ``kv_budget_bytes``. The estimate is ``(prompt + max_tokens) x
  cache_bytes_per_token x r`` (keys, values and the slots' position index), ``r`` what the last admitted
  request of the head's recipe held on its first step over that same product (1 until one has run),
  taken when the head is considered (requests that queued before the first of their recipe ran are
  estimated with what it held). A request always runs when nothing else does, so one larger than the
  budget is not refused forever.

One request is admitted at a time (its prefill is that admission), so a failure while admitting belongs
to it alone, and while rows are running admissions alternate with decode steps: a queue of long prompts does
not hold back the tokens of the rows already decoding. A long prompt's prefill is itself cut into slices of
about ``prefill_slice_s`` seconds with one decode step of the running rows between slices (chunked prefill
interleaved with decode, :class:`PrefillSlicer`), so one 1k-token prompt (~4 s on one CPU thread) no longer
stalls every running row for its whole prefill; an admission with no other row running is not sliced (there
is nothing to make room for, and slicing costs: bench/results/serve_load.json). Finished rows leave, their
results go back to their tickets; a cancelled ticket's row leaves the engine at once (:meth:`Engine.cancel`)
and its bytes with it. Past ``max_queue`` waiting requests a new one is refused (503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine
from ..engine.limits import cache_bytes_per_token
from ..errors import LonglabError
from .protocol import ApiError, Parsed, bad_request

__all__ = ["Ticket", "Scheduler", "PrefillSlicer", "sliceable"]

log = logging.getLogger("longlab.serve")


@dataclass
class Ticket:
    """One HTTP request on its way through the scheduler. Events (``(kind, value)`` on ``events``, put
    from the scheduler thread): ``("accepted", None)``, ``("delta", text)`` (streaming only),
    ``("done", Result)``, ``("error", ApiError)``."""

    parsed: Parsed
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    key: int | None = None
    estimate: int = 0
    size: int = 0  # (prompt + max_tokens) x cache_bytes_per_token: an uncompressed cache's bytes
    observed: bool = False
    sent: str = ""  # the text streamed so far
    first_token_s: float | None = None
    cancelled: bool = False

    def emit(self, kind: str, value: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


def sliceable(request: Any) -> bool:
    """Whether a request's admission may pause between slices of its prefill while other rows decode: its
    prefill changes nothing outside its own cache (no context compressor or prefill transform, which
    patch the model while they run; no documents, position method, draft model or prefill metrics)."""
    parsed = request.parsed
    return (parsed is not None and parsed.recipe.context is None and request.documents is None
            and getattr(parsed, "position", None) is None and getattr(parsed, "draft", None) is None
            and not request.prefill_metrics)


class PrefillSlicer:
    """Runs one admission (``engine.step()``, which prefills the admitted request) in a helper thread
    that hands control back to the scheduler thread every ``slice_s`` seconds of prefill, at the start of
    a decoder layer (a forward pre-hook on each layer that acts only in that helper thread). The two
    threads never run at once: a baton passes between them, so the engine is only ever touched by one
    thread at a time and every result is bit-for-bit what an unsliced prefill gives (the same forwards in
    the same order; the decode step that runs between two slices touches only the running rows' caches).

    ``start(fn)`` begins running ``fn`` and returns at its first pause or its end; ``resume()`` runs the
    next slice. ``done`` once ``fn`` returned; ``result`` / ``error`` hold what it returned or raised."""

    def __init__(self, model: Any, slice_s: float) -> None:
        self.slice_s = slice_s
        self._cv = threading.Condition()
        self._turn = "scheduler"
        self._thread: threading.Thread | None = None
        self._slice_start = 0.0
        self.done, self.result, self.error = True, None, None
        self.slices = 0
        self.always = False  # slice every admission, even one with no other row running (tests)
        layers = getattr(getattr(model, "model", None), "layers", None)
        self._handles = [layer.register_forward_pre_hook(self._pre) for layer in layers or ()]

    @property
    def active(self) -> bool:
        """Whether slicing works on this model (its decoder layers were found)."""
        return bool(self._handles)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: Any, args: Any) -> None:
        if threading.current_thread() is not self._thread:
            return None  # a decode step, another scheduler's prefill, or anything else: untouched
        if time.perf_counter() - self._slice_start >= self.slice_s:
            self._handoff("scheduler")  # pause here; the scheduler decodes a step, then resumes us
            self._slice_start = time.perf_counter()
        return None

    def _handoff(self, to: str) -> None:
        me = "prefill" if to == "scheduler" else "scheduler"
        with self._cv:
            self._turn = to
            self._cv.notify_all()
            while self._turn != me:
                self._cv.wait()

    def _body(self, fn: Any) -> None:
        with self._cv:  # wait for the first turn
            while self._turn != "prefill":
                self._cv.wait()
        self._slice_start = time.perf_counter()
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001  handed to the scheduler thread, which reports it
            self.error = exc
        with self._cv:
            self.done = True
            self._turn = "scheduler"
            self._cv.notify_all()

    def start(self, fn: Any) -> None:
        self.done, self.result, self.error = False, None, None
        self._thread = threading.Thread(target=self._body, args=(fn,), name="longlab-prefill", daemon=True)
        self._thread.start()
        self.resume()

    def resume(self) -> None:
        """Run the admission until its next pause or its end (the scheduler thread waits meanwhile)."""
        self.slices += 1
        self._handoff("prefill")
        if self.done and self._thread is not None:
            self._thread.join()
            self._thread = None


class Scheduler:
    def __init__(self, engine: Engine, *, kv_budget_bytes: int | None = None, max_batch: int = 16,
                 max_queue: int = 64, metrics: Any = None, prefill_slice_s: float | None = 0.5) -> None:
        self.engine = engine
        self.budget = kv_budget_bytes
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics
        self.per_token = cache_bytes_per_token(engine.model)
        self._cv = threading.Condition()
        self._inbox: deque[Ticket] = deque()  # arrived, not yet checked
        self._queue: deque[Ticket] = deque()  # checked, waiting for admission
        self._cancels: deque[Ticket] = deque()
        self._running: dict[int, Ticket] = {}
        self._ratio: dict[str, float] = {}
        self._stop = False
        self._admitted_last = False  # the last step was an admission (the next one decodes)
        self._thread: threading.Thread | None = None
        self.held = 0  # KV bytes the running requests hold (after the last step)
        self.peak_held = 0
        self.peak_running = 0  # the most requests admitted at once
        # chunked prefill: an admission pauses every prefill_slice_s seconds for a decode step (None: off)
        self.slicer = PrefillSlicer(engine.model, prefill_slice_s) if prefill_slice_s else None
        self._admitting: Ticket | None = None  # the ticket whose sliced admission is in flight
        self._cancel_admitting = False
        # where the scheduler thread's time goes (bench/serve_load.py records it): seconds and counts of
        # admission steps (a prefill), decode steps, and the rest of the loop (streaming, bookkeeping);
        # rows_when_budget_full: the most rows running when the KV budget refused the queue's head
        self.stats: dict[str, float] = {"prefill_s": 0.0, "prefills": 0, "decode_s": 0.0, "decodes": 0,
                                        "decode_rows": 0, "other_s": 0.0, "prefill_slices": 0,
                                        "decodes_during_prefill": 0, "rows_when_budget_full": 0}

    # ----------------------------------------------------------------------------- handler side
    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket`` (any thread); 503 with Retry-After past ``max_queue`` waiting requests."""
        with self._cv:
            if self._stop:
                raise ApiError(503, "the server is shutting down", type="server_error")
            if len(self._inbox) + len(self._queue) >= self.max_queue:
                if self.metrics is not None:
                    self.metrics.rejected(ticket.parsed.recipe)
                raise ApiError(503, f"the queue is full ({self.max_queue} requests wait); retry later",
                               type="server_error", code="queue_full", headers={"Retry-After": "1"})
            self._inbox.append(ticket)
            self._cv.notify()

    def cancel(self, ticket: Ticket) -> None:
        """The client left: drop the ticket's request wherever it is (any thread)."""
        with self._cv:
            ticket.cancelled = True
            self._cancels.append(ticket)
            self._cv.notify()

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._inbox) + len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="longlab-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # --------------------------------------------------------------------------- scheduler thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._inbox or self._cancels or self.engine.busy
                           or self._admitting is not None or (self._queue and self._can_admit())):
                    self._cv.wait(timeout=0.5)
                if self._stop:
                    break
                cancels, self._cancels = list(self._cancels), deque()
                inbox, self._inbox = list(self._inbox), deque()
            t0 = time.perf_counter()
            for t in cancels:
                self._drop(t)
            for t in inbox:
                self._accept(t)
            admitting = self._admitting
            if admitting is not None:  # a sliced prefill in flight: one decode step, then its next slice
                engine_s = 0.0
                if any(k != admitting.key for k in self._running):
                    engine_s = self._step(None)
                    self.stats["decodes_during_prefill"] += 1
                engine_s += self._step(admitting)
            else:
                admitting = self._admit_one()
                engine_s = self._step(admitting) if self.engine.busy else 0.0
            self._measure()
            self.stats["other_s"] += time.perf_counter() - t0 - engine_s
        while self._admitting is not None and self.slicer is not None and not self.slicer.done:
            self.slicer.resume()  # let the helper thread finish (bounded: the rest of one prefill)
        if self.slicer is not None:
            self.slicer.close()
        for t in [*self._inbox, *self._queue, *self._running.values()]:
            t.emit("error", ApiError(503, "the server is shutting down", type="server_error"))

    def _accept(self, t: Ticket) -> None:
        if t.cancelled:
            return
        req = t.parsed.request
        try:
            n = self.engine.check(req)
        except LonglabError as exc:
            t.emit("error", bad_request(exc, t.parsed.fields))
            self._count_error(t)
            return
        except Exception:  # noqa: BLE001  a bug, not the client's: logged with its traceback, 500
            log.exception("checking a request failed")
            t.emit("error", ApiError(500, "internal error while checking the request", type="server_error"))
            return
        if req.documents is not None:  # the reuse prefill tokenizes them; an estimate for the budget
            text = "\n".join(req.documents) + "\n" + (req.question or "")
            n = len(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        t.size = (n + req.max_new_tokens) * self.per_token
        t.estimate = int(t.size * self._ratio.get(t.parsed.recipe, 1.0))
        with self._cv:
            self._queue.append(t)
        t.emit("accepted")

    def _can_admit(self) -> bool:
        if not self._queue or len(self._running) >= self.max_batch:
            return False
        if self.budget is None or not self._running:
            return True
        head = self._queue[0]  # estimated with what its recipe is known to hold now (learnt as it waited)
        head.estimate = int(head.size * self._ratio.get(head.parsed.recipe, 1.0))
        fits = self.held + head.estimate <= self.budget
        if not fits:  # the budget, not max_batch, holds the queue back: how many rows it let in
            self.stats["rows_when_budget_full"] = max(self.stats["rows_when_budget_full"], len(self._running))
        return fits

    def _admit_one(self) -> Ticket | None:
        with self._cv:
            if not self._can_admit() or (self._admitted_last and self.engine.busy):
                self._admitted_last = False
                return None
            t = self._queue.popleft()
        self._admitted_last = True
        try:
            t.key = self.engine.submit(t.parsed.request)
        except LonglabError as exc:
            t.emit("error", bad_request(exc, t.parsed.fields))
            self._count_error(t)
            return None
        self._running[t.key] = t
        self.peak_running = max(self.peak_running, len(self._running))
        return t

    def _step(self, admitting: Ticket | None) -> float:
        """One engine step and what follows from it; returns the seconds the engine step took."""
        rows = len(self._running) - (admitting is not None)
        t0 = time.perf_counter()
        try:
            if admitting is not None and self._sliced(admitting):
                if self._admitting is None:
                    self._admitting = admitting
                    self.slicer.start(self.engine.step)  # type: ignore[union-attr]
                else:
                    self.slicer.resume()  # type: ignore[union-attr]
                if not self.slicer.done:  # type: ignore[union-attr]  paused between two slices
                    engine_s = time.perf_counter() - t0
                    self.stats["prefill_s"] += engine_s
                    self.stats["prefill_slices"] += 1
                    return engine_s
                self._admitting = None
                error, results = self.slicer.error, self.slicer.result  # type: ignore[union-attr]
                if error is not None:
                    raise error
                if self._cancel_admitting:  # the client left during its prefill: its row leaves now
                    self._cancel_admitting = False
                    self.engine.cancel(admitting.key)
            else:
                results = self.engine.step()
        except Exception as exc:  # noqa: BLE001
            self._admitting, self._cancel_admitting = None, False
            self._step_failed(exc, admitting)
            return time.perf_counter() - t0
        engine_s = time.perf_counter() - t0
        kind = "prefill" if admitting is not None else "decode"
        self.stats[kind + "_s"] += engine_s
        self.stats[kind + "s"] += 1
        if admitting is None:
            self.stats["decode_rows"] += rows
        progress = self.engine.progress()
        now = time.perf_counter()
        for key, tokens in progress.items():
            t = self._running.get(key)
            if t is None or not tokens:
                continue
            if t.first_token_s is None:
                self._first_token(t, now)
            if t.parsed.stream:
                self._stream(t, self._partial_text(t, tokens))
        for r in results:
            t = self._running.pop(r.key, None)
            r.cache = None  # the server keeps no cache past its request
            if t is None:
                continue
            if t.first_token_s is None:
                self._first_token(t, now)
            if t.parsed.stream:
                self._stream(t, r.text)
            t.emit("done", r)
            if self.metrics is not None:
                self.metrics.finished(t.parsed.recipe, r, now - t.arrived)
        return engine_s

    def _sliced(self, t: Ticket) -> bool:
        """Whether ``t``'s admission runs sliced: decided when it starts (a sliced one stays sliced), and
        only while other rows run, whose decode steps the slices make room for (alone, slicing would only
        cost: a helper thread and a pause every ``slice_s``; ``slicer.always`` slices every admission)."""
        if t is self._admitting:
            return True
        others = any(k != t.key for k in self._running)
        return (self.slicer is not None and self.slicer.active and self.slicer.slice_s > 0
                and (others or self.slicer.always) and sliceable(t.parsed.request))

    def _step_failed(self, exc: Exception, admitting: Ticket | None) -> None:
        if admitting is not None and admitting.key in self._running:  # the admission (prefill) failed
            self._running.pop(admitting.key)
            self.engine.cancel(admitting.key)
            if isinstance(exc, LonglabError):
                admitting.emit("error", bad_request(exc, admitting.parsed.fields))
            else:
                log.error("prefill failed: %s: %s", exc.__class__.__name__, exc)
                admitting.emit("error", ApiError(500, "internal error during prefill", type="server_error"))
            self._count_error(admitting)
            return
        log.exception("a decode step failed; the running requests are failed and the engine restarted",
                      exc_info=exc)
        for t in self._running.values():
            t.emit("error", ApiError(500, "internal error during decoding", type="server_error"))
            self._count_error(t)
        self._running.clear()
        old = self.engine
        self.engine = Engine(old.model, old.tokenizer, store=old.store)

    def _drop(self, t: Ticket) -> None:
        if t is self._admitting:  # mid-prefill: cancelled in the engine once the admission ends
            self._cancel_admitting = True
        with self._cv:
            found = t in self._queue or t.key is None
            if t in self._queue:
                self._queue.remove(t)
        if t.key is not None and self._running.pop(t.key, None) is not None:
            self.engine.cancel(t.key)
            found = True
        if found and self.metrics is not None:
            self.metrics.cancelled(t.parsed.recipe)

    def _first_token(self, t: Ticket, now: float) -> None:
        t.first_token_s = now - t.arrived
        if self.metrics is not None:
            self.metrics.ttft(t.parsed.recipe, t.first_token_s)

    def _count_error(self, t: Ticket) -> None:
        if self.metrics is not None:
            self.metrics.failed(t.parsed.recipe)

    # ---------------------------------------------------------------------------------- streaming
    def _partial_text(self, t: Ticket, tokens: list[int]) -> str:
        """The text of ``tokens`` that the final answer surely starts with: the engine strips the answer
        and cuts it at a stop string, so trailing whitespace, an unfinished UTF-8 character and a tail
        that may begin a stop string are held back."""
        text = self.engine.tokenizer.decode(tokens, skip_special_tokens=True).lstrip().rstrip("\ufffd")
        stop = t.parsed.request.stop
        if stop:
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            text = text[:cut] if cut >= 0 else text[: max(len(text) - max(map(len, stop)) + 1, 0)]
        return text.rstrip()

    def _stream(self, t: Ticket, text: str) -> None:
        if text.startswith(t.sent) and len(text) > len(t.sent):
            t.emit("delta", text[len(t.sent):])
            t.sent = text

    # ------------------------------------------------------------------------------------ metrics
    def _measure(self) -> None:
        held = self.engine.held_bytes() if self._running else {}
        self.held = sum(held.values())
        for key, n in held.items():  # learn what a request of this recipe holds, for admission estimates
            t = self._running.get(key)
            if t is not None and not t.observed and t.size:
                t.observed = True
                self._ratio[t.parsed.recipe] = n / t.size
        self.peak_held = max(self.peak_held, self.held)
        if self.metrics is None:
            return
        by_recipe: dict[str, int] = {}
        for key, n in held.items():
            t = self._running.get(key)
            if t is not None:
                by_recipe[t.parsed.recipe] = by_recipe.get(t.parsed.recipe, 0) + n
        self.metrics.state(self.queued, len(self._running), by_recipe)
