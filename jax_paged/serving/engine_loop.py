"""An engine on a thread or a process of its own, serving callers on other threads
(vLLM's AsyncLLM and its engine-core process).

`Engine` is single-threaded: `add_request`, `step` and `abort_request` must come from one
thread. A server's handlers run on many. A loop owns the engine: it adds what was
submitted, steps while a request is unfinished, and hands each request's events to its
`Submission`; it sleeps, holding no device, while none is:

    loop = EngineLoop(engine)                       # or EngineProcess(make_engine)
    sub = loop.submit([Request(prompt, 64), ...])   # any thread
    ids = sub.accepted()                            # the engine's ids of the requests
    for events in sub:                              # [TokenEvent] of each device call
      ...
    sub.cancel()                                    # a client gone: its requests abort
    loop.stats                                      # the engine's `EngineStats`
    loop.add_lora("sql", "path/to/adapter")         # between device calls (its reply
    loop.remove_lora("sql")                         #   awaited): the registered names
    loop.close()

From a coroutine (an asyncio server's handler), the same submission is awaited instead:

    sub = loop.submit([Request(prompt, 64)])       # in the event loop's thread
    ids = await sub.wait_accepted()
    async for events in sub:
      ...

`EngineLoop` runs the engine on a thread of this process. The engine's host work (its
scheduling, its Python between device calls) then shares the interpreter lock with the
callers' threads: a server formatting hundreds of streams slows every device call
(benchmarks/RESULTS.md, "OpenAI-compatible server"). `EngineProcess` builds the engine in
a process of its own, which does nothing else; requests and events cross a pipe.

A request joins the running batch at the next device call, so `Engine.steps_per_call`
bounds how long an arrival waits (16 is a serving setting: benchmarks/RESULTS.md,
"Serving requests as they arrive").
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import gc
import multiprocessing
import queue
import signal
import threading
import traceback
from typing import AsyncIterator, Callable, Iterator, Sequence

from jax_paged.serving.engine import Engine
from jax_paged.serving.report import EngineStats
from jax_paged.serving.request import Request, TokenEvent

_DONE = object()  # a submission's last item
# The guides an engine process keeps by reference (`EngineProcess`): a guide's table is
# ~33 MB for a JSON object over GPT-2's vocabulary, too much to pickle per request.
MAX_PROCESS_GUIDES = 64


class EngineClosed(RuntimeError):
  """The loop was closed (or its process ended): no more requests are taken, unfinished
  ones end."""


class Submission:
  """Submitted requests' events, in the order the engine produced them.

  Iterating yields lists of `TokenEvent` (each device call's, for every sample of every
  request; `TokenEvent.request_id` is the engine's id, `accepted()` maps them) until
  every sample has finished. It raises what made the requests fail: the engine's
  ValueError for a request it cannot serve (before any event; none of them runs), an
  exception of the engine's device call, or `EngineClosed`. `cancel()` aborts them
  (every sample); the iteration then ends without error.

  Made in a thread that runs an asyncio event loop (submitted from a coroutine), it is
  awaited instead (`await wait_accepted()`, `async for`): its events reach that loop
  through `call_soon_threadsafe`, and no thread blocks on it.
  """

  def __init__(self, requests: Sequence[Request], cancel: Callable[["Submission"], None]):
    if isinstance(requests, Request) or not requests:
      raise ValueError("requests must be a non-empty list of Request")
    self.requests = list(requests)
    self.request_ids: list[int] = []  # the engine's, once accepted
    self.key: int | None = None  # its name in an `EngineProcess`' messages
    self._cancel = cancel
    try:
      self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # (no event loop runs in this thread)
      self._loop = None
    self._items = queue.SimpleQueue() if self._loop is None else asyncio.Queue()
    self._accepted = threading.Event() if self._loop is None else asyncio.Event()
    self._error: BaseException | None = None
    self._taken = False  # (`_accept` ran: the loop's side knows, whatever thread waits)

  def _check_mode(self, awaited: bool) -> None:
    if awaited != (self._loop is not None):
      raise RuntimeError(
          "this submission was made in an event loop's thread: await wait_accepted() and "
          "use `async for`" if self._loop else "this submission was made outside an event "
          "loop: accepted() and `for` (submit from a coroutine to await it)")

  def accepted(self, timeout: float | None = None) -> list[int]:
    """Waits until the engine took the requests; returns their ids, in order. Raises the
    engine's ValueError if it cannot serve one (naming it by its index here),
    `EngineClosed` if the loop closed first, or TimeoutError."""
    self._check_mode(awaited=False)
    if not self._accepted.wait(timeout):
      raise TimeoutError("the engine loop did not take the requests in time")
    if self._error is not None:
      raise self._error
    return self.request_ids

  async def wait_accepted(self) -> list[int]:
    """`accepted()` for a submission made in an event loop (awaited, not blocking)."""
    self._check_mode(awaited=True)
    await self._accepted.wait()
    if self._error is not None:
      raise self._error
    return self.request_ids

  def cancel(self) -> None:
    """Aborts the requests, wherever they are (the engine's `abort_request`): no events
    come after their next device call. A no-op once they have finished."""
    self._cancel(self)

  def __iter__(self) -> Iterator[list[TokenEvent]]:
    self.accepted()
    while (item := self._items.get()) is not _DONE:
      if isinstance(item, BaseException):
        raise item
      yield item

  async def __aiter__(self) -> AsyncIterator[list[TokenEvent]]:
    await self.wait_accepted()
    while (item := await self._items.get()) is not _DONE:
      if isinstance(item, BaseException):
        raise item
      yield item

  # Called by the loop (the engine's thread, or the reader of its process's pipe):
  def _in_owner(self, fn: Callable, *args) -> None:
    """fn(*args) here, or in the submission's event loop (dropped if it has closed: no
    one awaits it any more)."""
    if self._loop is None:
      fn(*args)
      return
    try:
      self._loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed
      pass

  def _put(self, *items) -> None:
    for item in items:
      self._in_owner(self._items.put_nowait, item)

  def _accept(self, request_ids: list[int], error: BaseException | None = None) -> None:
    self.request_ids, self._error, self._taken = request_ids, error, True
    self._in_owner(self._accepted.set)
    if error is not None:
      self._put(_DONE)

  def _deliver(self, events: list[TokenEvent], finished: bool) -> None:
    self._put(events, *((_DONE,) if finished else ()))

  def _end(self, error: BaseException | None = None) -> None:
    if not self._taken:
      self._accept([], error or EngineClosed("the engine loop was closed"))
      return
    self._put(*((error,) if error is not None else ()), _DONE)


class _Core:
  """The engine's side of a loop. Commands come from `receive(block)` (None: none
  waiting): ("add", key, requests), ("cancel", key), ("lora", key, op, args), ("stop",).
  What happens goes to `out`: accepted(key, ids, error), events(key, events, finished)
  per device call and key, then stats(the engine's `EngineStats`) and flush() (also once
  at the start), failed(keys, error), and replied(key, value, error) to a "lora". A key
  names a submission, or a reply."""

  def __init__(self, engine: Engine, out):
    self.engine, self.out = engine, out
    self.live: dict[int, object] = {}  # engine id -> its key
    self.samples: dict[object, int] = {}  # key -> its samples not yet finished
    self.ids: dict[object, list[int]] = {}  # key -> its engine ids

  def run(self, receive: Callable[[bool], tuple | None]) -> None:
    engine = self.engine
    self.out.stats(engine.stats())
    self.out.flush()
    while True:
      # Idle: sleep until something is submitted. Busy: take what came during the call.
      block = not engine.has_unfinished_requests()
      while (command := receive(block)) is not None:
        block = False
        if command[0] == "stop":
          engine.abort()
          self.out.failed(list(self.samples), EngineClosed("the engine loop was closed"))
          return
        getattr(self, "_" + command[0])(*command[1:])
      if not engine.has_unfinished_requests():
        continue
      try:
        events = engine.step()
      except Exception as e:  # the engine aborted the run: each of its requests fails
        self.out.failed(list(self.samples), e)
        self.live.clear()
        self.samples.clear()
        self.ids.clear()
        self.out.stats(engine.stats())
        self.out.flush()
        continue
      by_key: dict[object, list[TokenEvent]] = {}
      for event in events:
        key = self.live.get(event.request_id)
        if key is not None:
          by_key.setdefault(key, []).append(event)
      for key, key_events in by_key.items():
        self.samples[key] -= sum(e.finish_reason is not None for e in key_events)
        finished = self.samples[key] <= 0
        self.out.events(key, key_events, finished)
        if finished:
          self._forget(key)
      self.out.stats(engine.stats())
      self.out.flush()

  def _forget(self, key) -> list[int]:
    del self.samples[key]
    ids = self.ids.pop(key)
    for rid in ids:
      del self.live[rid]
    return ids

  def _add(self, key, requests: Sequence[Request]) -> None:
    try:
      ids = self.engine.add_requests(requests)
    except ValueError as e:  # (all or none)
      self.out.accepted(key, [], e)
      return
    for rid in ids:
      self.live[rid] = key
    self.samples[key] = sum(r.n for r in requests)
    self.ids[key] = ids
    self.out.accepted(key, ids, None)

  def _cancel(self, key) -> None:
    if key in self.samples:
      for rid in self._forget(key):
        self.engine.abort_request(rid)
      self.out.failed([key], None)

  def _lora(self, key, op: str, args: tuple) -> None:
    """`Engine.add_lora(*args)` ("add") or `remove_lora(*args)` ("remove") between device
    calls; replies the registered adapters' names, or the user's error."""
    try:
      (self.engine.add_lora if op == "add" else self.engine.remove_lora)(*args)
    except (ValueError, KeyError, FileNotFoundError) as e:
      self.out.replied(key, None, e)
    else:
      self.out.replied(key, self.engine.loras, None)


class _DirectOut:
  """A thread loop's outputs: straight to the submissions (the keys); the engine's
  latest `EngineStats` in `stats_now`."""

  stats_now: EngineStats | None = None

  def stats(self, stats: EngineStats) -> None:
    self.stats_now = stats

  @staticmethod
  def accepted(sub: Submission, ids: list[int], error: BaseException | None) -> None:
    sub._accept(ids, error)

  @staticmethod
  def events(sub: Submission, events: list[TokenEvent], finished: bool) -> None:
    sub._deliver(events, finished)

  @staticmethod
  def flush() -> None:
    pass

  @staticmethod
  def failed(subs: list, error: BaseException | None) -> None:
    for sub in subs:
      sub._end(error)

  @staticmethod
  def replied(reply: concurrent.futures.Future, value, error: BaseException | None) -> None:
    if error is None:
      reply.set_result(value)
    else:
      reply.set_exception(error)


def _user_error(error: BaseException) -> str:
  """An engine's refusal as one line (a KeyError's str() would quote it)."""
  return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


class _LoraUpdates:
  """A loop's runtime LoRA updates: `Engine.add_lora` / `remove_lora` run by the loop
  between device calls (`_request`: the command sent, its reply awaited)."""

  def add_lora(self, name: str, path: str, timeout: float | None = None) -> list[str]:
    """Registers the PEFT adapter at `path` as `name` (`Engine.add_lora`); returns the
    registered adapters' names. Raises as that does (ValueError, FileNotFoundError)."""
    return self._request("add", (name, path), timeout)

  def remove_lora(self, name: str, timeout: float | None = None) -> list[str]:
    """Unregisters adapter `name` (`Engine.remove_lora`); returns the registered
    adapters' names. Raises as that does (KeyError, ValueError)."""
    return self._request("remove", (name,), timeout)


class EngineLoop(_LoraUpdates):
  """Runs `engine` on a daemon thread of this process until `close()`; `submit` from any
  thread.

  A device call that raises aborts the run (`Engine.step`): every request in it fails
  with that exception, and the loop goes on serving new ones on the emptied pool.
  """

  def __init__(self, engine: Engine):
    if engine.has_unfinished_requests():
      raise ValueError("engine has a run in progress: an EngineLoop takes an idle engine")
    self.engine = engine
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()  # orders submit() before close()'s stop
    self._closing = False
    self._out = _DirectOut()
    self._core = _Core(engine, self._out)
    self._thread = threading.Thread(target=self._core.run, args=(self._receive,),
                                    name="jax_paged-engine-loop", daemon=True)
    self._thread.start()

  def _receive(self, block: bool) -> tuple | None:
    try:
      return self._inbox.get(block=block)
    except queue.Empty:
      return None

  def submit(self, requests: Sequence[Request]) -> Submission:
    """Queues `requests` for the engine, together (all or none run); their events come
    through the returned submission, whose `accepted()` raises if the engine cannot serve
    one. Raises `EngineClosed` after `close()`."""
    sub = Submission(requests, lambda s: self._inbox.put(("cancel", s)))
    with self._lock:
      if self._closing:
        raise EngineClosed("the engine loop was closed")
      self._inbox.put(("add", sub, sub.requests))
    return sub

  def _request(self, op: str, args: tuple, timeout: float | None) -> list[str]:
    reply = concurrent.futures.Future()
    with self._lock:
      if self._closing:
        raise EngineClosed("the engine loop was closed")
      self._inbox.put(("lora", reply, op, args))
    return reply.result(timeout)

  @property
  def num_unfinished(self) -> int:
    """Submissions taken and not yet finished (a snapshot)."""
    return len(self._core.samples)

  @property
  def alive(self) -> bool:
    """Whether the loop takes submissions (not closed; its thread running)."""
    return not self._closing and self._thread.is_alive()

  @property
  def stats(self) -> EngineStats | None:
    """The engine's `EngineStats` after its latest device call (None until the loop has
    started)."""
    return self._out.stats_now

  def close(self, timeout: float | None = None) -> None:
    """Stops the loop: unfinished requests fail with `EngineClosed` (their run aborted),
    and the thread ends. Idempotent."""
    with self._lock:
      if not self._closing:
        self._closing = True
        self._inbox.put(("stop",))
    self._thread.join(timeout)


class _PipeOut:
  """An engine process's outputs, over its pipe; a device call's events and the
  engine's stats after it in one message."""

  def __init__(self, conn):
    self.conn, self.batch, self.stats_now = conn, [], None

  def stats(self, stats: EngineStats) -> None:
    self.stats_now = tuple(stats)  # (plain: see `events`)

  def accepted(self, key: int, ids: list[int], error: BaseException | None) -> None:
    self.conn.send(("accepted", key, ids, None if error is None else str(error)))

  def events(self, key: int, events: list[TokenEvent], finished: bool) -> None:
    # (As plain tuples: a named tuple pickles with its class, to be rebuilt by a call.)
    self.batch.append((key, [tuple(e) for e in events], finished))

  def flush(self) -> None:
    self.conn.send(("events", self.batch, self.stats_now))
    self.batch = []

  def failed(self, keys: list, error: BaseException | None) -> None:
    if keys:  # (the error by its type's name and message: it may not pickle)
      self.conn.send(("failed", keys, None if error is None else
                      (type(error).__name__, str(error))))

  def replied(self, key: int, value, error: BaseException | None) -> None:
    self.conn.send(("replied", key, value, None if error is None else
                    (type(error).__name__, _user_error(error))))


def _serve_in_process(make_engine: Callable[[], Engine], conn) -> None:
  """An engine process's body: build the engine, say what it serves, run the core. Ctrl-C
  is the parent's to handle (it closes the loop)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    engine = make_engine()
  except Exception as e:  # (said to the parent, which raises it)
    if not isinstance(e, ValueError):  # not the user's error: the details, for a report
      traceback.print_exc()
    conn.send(("broken", str(e)))
    return
  # What the process holds from now on (the model, the compiled programs) out of the
  # garbage collector's full collections, as `Engine.warmup` does (without a warm-up
  # too): each would walk it all, stalling a device call.
  gc.collect()
  gc.freeze()
  conn.send(("ready", engine.spec, engine.max_batch))

  guides = {}  # the parent's guide keys -> guides (`EngineProcess._by_reference`)

  def receive(block: bool) -> tuple | None:
    while True:
      if not block and not conn.poll():
        return None
      try:
        message = conn.recv()
      except EOFError:  # the parent is gone
        return ("stop",)
      if message[0] != "guides":
        break
      _, sent, forget = message
      guides.update(sent)
      for key in forget:
        del guides[key]
    if message[0] == "add":
      kind, key, requests = message
      message = kind, key, [r if r.guide is None else
                            dataclasses.replace(r, guide=guides[r.guide.key])
                            for r in requests]
    return message

  _Core(engine, _PipeOut(conn)).run(receive)


@dataclasses.dataclass(frozen=True)
class _GuideKey:
  """A guide sent to the engine process before, by its key there."""

  key: int


class EngineProcess(_LoraUpdates):
  """Runs the engine that `make_engine()` builds in a process of its own (spawned: a
  fresh interpreter) until `close()`; `submit` from any thread of this one.

  `make_engine` must be picklable (a module-level function, or a `functools.partial` of
  one); it runs in the child, which owns the devices: this process must not touch them
  (a GPU initialized here first would hold most of its memory). Its ModelSpec and slots
  are `spec` and `max_batch` here once the constructor returns.

  Raises RuntimeError if the engine cannot be built (naming why). A device call that
  raises fails the requests of its run, as in `EngineLoop`; if the process dies, every
  unfinished request fails with `EngineClosed` and later submissions raise it.
  """

  def __init__(self, make_engine: Callable[[], Engine]):
    context = multiprocessing.get_context("spawn")
    self._conn, child = context.Pipe()
    self._process = context.Process(target=_serve_in_process, args=(make_engine, child),
                                    name="jax_paged-engine", daemon=True)
    self._process.start()
    child.close()
    try:
      message = self._conn.recv()
    except EOFError:
      self._process.join()
      message = ("broken", f"its process ended (exit code {self._process.exitcode})")
    if message[0] == "broken":
      self._process.join()
      raise RuntimeError(f"the engine could not be built: {message[1]}")
    _, self.spec, self.max_batch = message
    self.stats: EngineStats | None = None  # the engine's, after its latest device call
    self._subs: dict[int, Submission] = {}  # key -> unfinished submission
    self._next_key = 0
    self._guides: collections.OrderedDict = collections.OrderedDict()  # guide -> its key
    # in the process, least recently sent first
    self._replies: dict[int, concurrent.futures.Future] = {}  # key -> awaited reply
    self._lock = threading.Lock()  # the pipe's sending end, keys, closing
    self._closed = False
    self._reader = threading.Thread(target=self._read, name="jax_paged-engine-reader",
                                    daemon=True)
    self._reader.start()

  def submit(self, requests: Sequence[Request]) -> Submission:
    """As `EngineLoop.submit`."""
    sub = Submission(requests, self._cancel)
    with self._lock:
      if self._closed:
        raise EngineClosed("the engine process was closed")
      key, self._next_key = self._next_key, self._next_key + 1
      sub.key = key
      self._subs[key] = sub
      self._send(("add", key, self._by_reference(sub.requests)))
    return sub

  def _by_reference(self, requests: Sequence[Request]) -> list[Request]:
    """The requests with each guide the process holds as its key (`_GuideKey`); guides it
    does not hold are sent first, and the least recently used beyond MAX_PROCESS_GUIDES
    (or these requests' guides) forgotten there. (Under the lock.)"""
    if all(r.guide is None for r in requests):
      return list(requests)
    sent = {}
    for r in requests:
      if r.guide is None:
        continue
      if r.guide in self._guides:
        self._guides.move_to_end(r.guide)
      else:
        key, self._next_key = self._next_key, self._next_key + 1
        self._guides[r.guide], sent[key] = key, r.guide
    # (Never one of these requests': they were moved last.)
    keep = max(MAX_PROCESS_GUIDES, len({r.guide for r in requests if r.guide is not None}))
    forget = []
    while len(self._guides) > keep:
      forget.append(self._guides.popitem(last=False)[1])
    if sent or forget:
      self._send(("guides", sent, forget))
    return [r if r.guide is None else dataclasses.replace(r, guide=_GuideKey(self._guides[
        r.guide])) for r in requests]

  def _request(self, op: str, args: tuple, timeout: float | None) -> list[str]:
    reply = concurrent.futures.Future()
    with self._lock:
      if self._closed:
        raise EngineClosed("the engine process was closed")
      key, self._next_key = self._next_key, self._next_key + 1
      self._replies[key] = reply
      self._send(("lora", key, op, args))
    return reply.result(timeout)

  @property
  def num_unfinished(self) -> int:
    """Submissions sent and not yet finished (a snapshot)."""
    return len(self._subs)

  @property
  def alive(self) -> bool:
    """Whether the engine's process takes submissions (not closed, not ended)."""
    return not self._closed and self._process.is_alive()

  def close(self, timeout: float | None = None) -> None:
    """Stops the engine's process: unfinished requests fail with `EngineClosed`.
    Idempotent."""
    with self._lock:
      if not self._closed:
        self._closed = True
        self._send(("stop",))
    self._reader.join(timeout)
    self._process.join(timeout)

  def _send(self, message: tuple) -> None:
    try:
      self._conn.send(message)
    except (BrokenPipeError, OSError):  # the process has ended: the reader says so
      pass

  def _cancel(self, sub: Submission) -> None:
    with self._lock:
      self._send(("cancel", sub.key))

  def _read(self) -> None:
    subs = self._subs
    while True:
      try:
        message = self._conn.recv()
      except (EOFError, OSError):
        break
      kind = message[0]
      if kind == "events":
        self.stats = EngineStats._make(message[2])  # (current when the events arrive)
        for key, packed, finished in message[1]:
          sub = subs.pop(key) if finished else subs[key]
          sub._deliver([TokenEvent._make(p) for p in packed], finished)
      elif kind == "accepted":
        _, key, ids, error = message
        sub = subs[key] if error is None else subs.pop(key)
        sub._accept(ids, None if error is None else ValueError(error))
      elif kind == "replied":
        _, key, value, error = message
        reply = self._replies.pop(key)
        if error is None:
          reply.set_result(value)
        else:
          name, text = error
          reply.set_exception({"KeyError": KeyError, "FileNotFoundError": FileNotFoundError
                               }.get(name, ValueError)(text))
      elif kind == "failed":
        _, keys, error = message
        if error is not None:
          name, text = error
          error = (EngineClosed(text) if name == EngineClosed.__name__
                   else RuntimeError(f"the engine failed: {name}: {text}"))
        for key in keys:
          sub = subs.pop(key, None)  # (None: ended here already)
          if sub is not None:
            sub._end(error)
    # The process has ended (closed, or died): nothing more comes.
    with self._lock:
      self._closed = True
      ended = list(subs.values())
      subs.clear()
      replies = list(self._replies.values())
      self._replies.clear()
    for reply in replies:
      reply.set_exception(EngineClosed("the engine process ended"))
    self._process.join()
    for sub in ended:
      sub._end(EngineClosed(f"the engine process ended (exit code "
                            f"{self._process.exitcode})"))
