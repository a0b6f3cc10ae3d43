"""Swaps that keep the cache (issue 33): llama-server slots saved before the pool unloads a model
(idle, or evicted for another) and restored into its next replicas before they serve (docs/lifecycle.md:
KV cache across swaps).

`store` (the slot files under <state_dir>/kv, their index and the disk budget), `slots_api`
(llama-server's /slots endpoints, their answers checked), `keeper` (what is saved and restored,
and when; the fingerprint a file must match). May import `placement/` (its settings key), `state/`,
`upstream/`, launchers' specs and the root vocabulary; the pool and the monitor use it, and the
programs get its --slot-save-path through the pool's launch hook (kinds/ never imports it).
"""
