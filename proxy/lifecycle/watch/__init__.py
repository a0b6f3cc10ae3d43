"""Keeping replica states true while the pool's decisions run.

`monitor` (supervisord polls, health probes, engine gauge scrapes, the data path's outcomes),
`health` (outlier ejection with a back-off), `warmup` (one short generation before READY) and
`crashes` (how a process ended, in supervisord's words). May import `kvcache/` (a starting
replica's saved slots, restored before it is READY), `kinds/` (the programs' process table),
`state/`, `proxy.upstream`, `supervisord/` and the root vocabulary; never `placement/` itself or
the pool.
"""
