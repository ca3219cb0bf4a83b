"""Serving load (``workload=serving``): open-loop arrivals, a continuous-batching scheduler over the
decoder with a slot or a paged KV store, and the serving metrics computed from its timeline."""
