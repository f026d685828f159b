"""The engine: requests in, tokens out, one step at a time (schedule -> execute -> update).

`core` is the step loop and admission; `scheduler` the policy (which tokens run next), over
the state it moves (`sequence`) and the values a step produces (`scheduler_output`); `runner`
turns a step into one model forward, a decode step through its compiled bucket (`compiled`,
with `cuda_graphs` on GPUs); `output` turns sampled tokens into the events of each request
(with `detokenize`), which `events` carries across threads; `resume` continues a stream another
worker began; `pooling` embeds whole texts; `liveness` tells a hung engine from an idle one;
`metrics` is the worker's Prometheus registry. `build` assembles the engine for one bound
device (its CPU paths, the KV cache of `kv_cache`, runner, scheduler, grammars, compiled step)
and `describe` what `/capability` says of the worker; workers/main.py runs both in the
mission's order."""
