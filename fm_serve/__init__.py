"""An overlap-scheduled serving loop on a small JAX transformer, built on fm_jax.

Modules, one job each:
  config     model and engine settings (default and tiny);
  model      the decoder-only transformer and its slot-indexed KV cache;
  step       the jitted forward step (sync: plain; overlap: fm_jax resolve/publish/stash inlined);
  requests   the request set and a request's host-side state;
  scheduler  continuous batching: admission, chunked prefill, decode, MIXED, retirement;
  host_cost  the simulated host scheduling cost;
  engine     the synchronous and the overlap serving loops;
  sweep      forward-time calibration and the sync-vs-overlap sweep;
  report     table, markdown, JSON and PNG outputs;
  cli        the `fm-serve-demo` console script.
"""
