"""An engine on a thread of its own, serving callers on other threads (vLLM's AsyncLLM).

`Engine` is single-threaded: `add_request`, `step` and `abort_request` must come from one
thread. A server's handlers run on many. `EngineLoop` owns the engine on its thread,
which adds what was submitted, steps while a request is unfinished, and hands each
request's events to its `Submission`; it sleeps, holding no device, while none is:

    loop = EngineLoop(engine)
    sub = loop.submit([Request(prompt, 64), ...])   # any thread
    ids = sub.accepted()                            # the engine's ids of the requests
    for events in sub:                              # [TokenEvent] of each device call
      ...
    sub.cancel()                                    # a client gone: its requests abort
    loop.close()

A request joins the running batch at the next device call, so `Engine.steps_per_call`
bounds how long an arrival waits (16 is a serving setting: benchmarks/RESULTS.md,
"Serving requests as they arrive").
"""

from __future__ import annotations

import queue
import re
import threading
from typing import Iterator, Sequence

from jax_paged.serving.engine import Engine
from jax_paged.serving.request import Request, TokenEvent

_DONE = object()  # a submission's last item


class EngineClosed(RuntimeError):
  """The loop was closed: no more requests are taken, unfinished ones end."""


class Submission:
  """Submitted requests' events, in the order the engine produced them.

  Iterating yields lists of `TokenEvent` (each device call's, for every sample of every
  request; `TokenEvent.request_id` is the engine's id, `accepted()` maps them) until
  every sample has finished. It raises what made the requests fail: the engine's
  ValueError for a request it cannot serve (before any event; none of them runs), an
  exception of the engine's device call, or `EngineClosed`. `cancel()` aborts them
  (every sample); the iteration then ends without error.
  """

  def __init__(self, loop: "EngineLoop", requests: Sequence[Request]):
    self.requests = list(requests)
    self.request_ids: list[int] = []  # the engine's, once accepted
    self._loop = loop
    self._items: queue.SimpleQueue = queue.SimpleQueue()
    self._accepted = threading.Event()
    self._error: BaseException | None = None
    self._unfinished = sum(r.n for r in self.requests)  # samples (loop thread only)

  def accepted(self, timeout: float | None = None) -> list[int]:
    """Waits until the engine took the requests; returns their ids, in order. Raises the
    engine's ValueError if it cannot serve one (naming it by its index here),
    `EngineClosed` if the loop closed first, or TimeoutError."""
    if not self._accepted.wait(timeout):
      raise TimeoutError("the engine loop did not take the requests in time")
    if self._error is not None:
      raise self._error
    return self.request_ids

  def cancel(self) -> None:
    """Aborts the requests, wherever they are (the engine's `abort_request`): no events
    come after their next device call. A no-op once they have finished."""
    self._loop._inbox.put((self._loop._cancel, self))

  def __iter__(self) -> Iterator[list[TokenEvent]]:
    self.accepted()
    while (item := self._items.get()) is not _DONE:
      if isinstance(item, BaseException):
        raise item
      yield item

  # On the loop's thread:
  def _accept(self, request_ids: list[int], error: BaseException | None = None) -> None:
    self.request_ids, self._error = request_ids, error
    self._accepted.set()
    if error is not None:
      self._items.put(_DONE)

  def _deliver(self, events: list[TokenEvent]) -> bool:
    """Hands over events; returns whether every sample has finished."""
    self._items.put(events)
    self._unfinished -= sum(e.finish_reason is not None for e in events)
    if self._unfinished <= 0:
      self._items.put(_DONE)
      return True
    return False

  def _end(self, error: BaseException | None = None) -> None:
    if error is not None:
      self._items.put(error)
    self._items.put(_DONE)


class EngineLoop:
  """Runs `engine` on a daemon thread until `close()`; `submit` from any thread.

  A device call that raises aborts the run (`Engine.step`): every request in it fails
  with that exception, and the loop goes on serving new ones on the emptied pool.
  """

  def __init__(self, engine: Engine):
    if engine.has_unfinished_requests():
      raise ValueError("engine has a run in progress: an EngineLoop takes an idle engine")
    self.engine = engine
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (function, argument); None: stop
    self._live: dict[int, Submission] = {}  # engine id -> its unfinished submission
    self._lock = threading.Lock()  # orders submit() before close()'s stop
    self._closing = False
    self._thread = threading.Thread(target=self._run, name="jax_paged-engine-loop",
                                    daemon=True)
    self._thread.start()

  def submit(self, requests: Sequence[Request]) -> Submission:
    """Queues `requests` for the engine, together (all or none run); their events come
    through the returned submission, whose `accepted()` raises if the engine cannot serve
    one. Raises `EngineClosed` after `close()`."""
    if isinstance(requests, Request) or not requests:
      raise ValueError("requests must be a non-empty list of Request")
    sub = Submission(self, requests)
    with self._lock:
      if self._closing:
        raise EngineClosed("the engine loop was closed")
      self._inbox.put((self._add, sub))
    return sub

  @property
  def num_unfinished(self) -> int:
    """Requests taken and not yet finished (a snapshot)."""
    return len(self._live)

  def close(self, timeout: float | None = None) -> None:
    """Stops the loop: unfinished requests fail with `EngineClosed` (their run aborted),
    and the thread ends. Idempotent."""
    with self._lock:
      if not self._closing:
        self._closing = True
        self._inbox.put((None, None))
    self._thread.join(timeout)

  def _run(self) -> None:
    engine = self.engine
    stopped = False
    while not stopped:
      # Idle: sleep until something is submitted. Busy: take what came during the call.
      block = not engine.has_unfinished_requests()
      try:
        while True:
          function, argument = self._inbox.get(block=block)
          if function is None:  # close()
            stopped = True
            break
          function(argument)
          block = False
      except queue.Empty:
        pass
      if stopped or not engine.has_unfinished_requests():
        continue
      try:
        events = engine.step()
      except Exception as e:  # the engine aborted the run: each of its requests fails
        for sub in set(self._live.values()):
          sub._end(e)
        self._live.clear()
        continue
      by_submission: dict[int, tuple[Submission, list[TokenEvent]]] = {}
      for event in events:
        sub = self._live.get(event.request_id)
        if sub is not None:
          by_submission.setdefault(id(sub), (sub, []))[1].append(event)
      for sub, sub_events in by_submission.values():
        if sub._deliver(sub_events):
          for rid in sub.request_ids:
            del self._live[rid]
    # Closed: what is unfinished fails (submit() takes no more).
    engine.abort()
    for sub in set(self._live.values()):
      sub._end(EngineClosed("the engine loop was closed"))
    self._live.clear()

  def _add(self, sub: Submission) -> None:
    ids = []
    try:
      for request in sub.requests:
        ids.append(self.engine.add_request(request))
    except ValueError as e:  # all or none: those added are dropped again
      for rid in ids:
        self.engine.abort_request(rid)
      # The engine names the request by the id it would have had: here, by its index.
      message = re.sub(r"^request \d+: ", "", str(e))
      if len(sub.requests) > 1:
        message = f"requests[{len(ids)}]: {message}"
      sub._accept([], ValueError(message))
      return
    for rid in ids:
      self._live[rid] = sub
    sub._accept(ids)

  def _cancel(self, sub: Submission) -> None:
    live = [rid for rid in sub.request_ids if self._live.get(rid) is sub]
    for rid in live:
      del self._live[rid]
      self.engine.abort_request(rid)
    if live:
      sub._end()
