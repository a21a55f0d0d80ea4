"""Which LoRA adapter sits in which of the model's device slots (host bookkeeping).

The engine registers any number of adapters (`Engine.add_lora`); the model holds
`max_loras` of them at once (`jax_paged.lora`). A request is admitted only with its
adapter in a slot: already there, or loaded into a free slot or one whose adapter no
admitted sequence uses (the least recently used such), as vLLM's LoRA manager does. The
scheduler takes a reference per sequence it admits and drops it when the sequence leaves
its slot; the runner loads what `take_loads` lists before the call that needs it.
"""

from __future__ import annotations

import itertools

from jax_paged import lora as lora_lib


class AdapterSlots:
  """The adapters registered and the `max_loras` device slots they take turns in.

  Attributes:
    max_loras: the device slots.
    adapters: name -> its `LoraAdapter`.
    uids: name -> a number unique to its registration (salts its prefix-cache keys: K/V
      computed under one adapter is never served to another, nor to a later adapter
      registered under the same name).
  """

  def __init__(self, max_loras: int):
    self.max_loras = max_loras
    self.adapters: dict[str, lora_lib.LoraAdapter] = {}
    self.uids: dict[str, int] = {}
    self._names: list[str | None] = [None] * max_loras  # each slot's adapter
    self._users = [0] * max_loras  # sequences admitted with each slot's adapter
    self._last_used = [0] * max_loras
    self._clock = itertools.count(1)
    self._uid = itertools.count(1)
    self._loads: list[tuple[int, lora_lib.LoraAdapter]] = []

  def add(self, name: str, adapter: lora_lib.LoraAdapter) -> None:
    """Registers (or replaces, when none of its sequences is admitted) an adapter."""
    if name in self._names and self._users[self._names.index(name)]:
      raise ValueError(f"LoRA adapter {name!r} is in use by running requests; remove it "
                       "once they finish")
    self.remove(name)
    self.adapters[name] = adapter
    self.uids[name] = next(self._uid)

  def remove(self, name: str) -> None:
    """Unregisters an adapter (and frees its slot); a no-op for an unknown name. The
    caller makes sure no waiting or running request names it."""
    self.adapters.pop(name, None)
    self.uids.pop(name, None)
    if name in self._names:
      self._names[self._names.index(name)] = None

  def in_use(self, name: str) -> bool:
    return name in self._names and self._users[self._names.index(name)] > 0

  def acquire(self, name: str, count: int = 1) -> int | None:
    """The slot holding adapter `name` with `count` more references, loading it into a
    free or idle slot if needed (queued for `take_loads`); None when every slot holds
    an adapter in use."""
    if name in self._names:
      slot = self._names.index(name)
    else:
      idle = [i for i in range(self.max_loras) if not self._users[i]]
      if not idle:
        return None
      slot = min(idle, key=lambda i: (self._names[i] is not None, self._last_used[i]))
      self._names[slot] = name
      self._loads.append((slot, self.adapters[name]))
    self._users[slot] += count
    self._last_used[slot] = next(self._clock)
    return slot

  def release(self, slot: int) -> None:
    """Drops one reference to the adapter in `slot` (a sequence left its slot)."""
    if self._users[slot] <= 0:
      raise AssertionError(f"LoRA slot {slot} released more often than acquired")
    self._users[slot] -= 1

  def drop_holds(self) -> None:
    """Forgets every reference (a run ended: its sequences left their slots)."""
    self._users = [0] * self.max_loras

  def take_loads(self) -> list[tuple[int, lora_lib.LoraAdapter]]:
    """(slot, adapter) pairs to load before the next call, in order (a slot loaded twice
    since the last call: its last load)."""
    loads, self._loads = self._loads, []
    return list({slot: (slot, adapter) for slot, adapter in loads}.values())
