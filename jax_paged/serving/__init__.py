"""The serving layer, in vLLM v1's three roles:

  scheduler         plans each device call (host, numpy): requests, admission, preemption,
                    with the page accounting in `kv_cache_manager` and the admission
                    policies in `admission`
  runner            executes a plan on device: the jitted prefill and multi-step decode
                    loop over the pool, row packing, sampling (the one jit wrapper)
  engine            the loop: schedule -> execute -> update; streaming, the `Report`, `stats()`
  engine_loop       an engine on a thread (`EngineLoop`) or a process (`EngineProcess`) of
                    its own, for callers on many threads (the HTTP server)

`request` holds `Request`, `TokenEvent` and their one validation; `static_batch` the
one-batch `jax_paged.generate`; `beam_search` beam search over the pool.
"""
