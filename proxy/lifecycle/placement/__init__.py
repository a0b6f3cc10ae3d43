"""Where models may live, and the hand that carries it out.

`rules` (pure: which models may be resident together; what to load, evict, wait for or refuse),
`memory` (what a model needs on which device, each device's budget), `footprints` (measured
footprints, kept), `load_retry` (pure: which failed loads are tried again, when) and `placer`,
which turns the models' state into the rules' picture and acts on what they decide only through
the actions it is given at construction (`actions`: the PlacerActions protocol the pool
implements, and the clock it reads); `usage` (each model's last use, kept) and `placer_view`
(what the placer shows admins). May import `state/`, `gpu/`, `supervisord/`'s host
records and the root vocabulary; the pure modules no asyncio, aiohttp or I/O library.
"""
