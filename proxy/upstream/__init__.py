"""The wing that talks to replicas: the data path's HTTP client and what it returns.

It owns the keep-alive HTTP/1.1 client to replicas (`client`), how a request reaches one replica
whatever its kind (`reach`: the `Reach` protocol and a program's plain-HTTP reach) and the reader of
an engine's Prometheus gauges (`engine_metrics`). Below both `serving/` (which sends through it)
and `lifecycle/` (whose health checks and kinds use it); it imports launchers' specs and the root
vocabulary, never a model's state or the pool.
"""
