"""The tenants wing: who calls the data plane, what each may use, and what each spent.

`keys` (a key, looked up by its digest, names its tenant; keys are never held in clear), `limits`
(pure: the per-minute limits, the budget's period, what a request costs and may cost at most),
`spending` (each tenant's sums and reservations in memory, read from the ledger at start), `ledger`
(the usage ledger and the minted keys: the `Ledger` protocol and its SQLite store), `rows` (a ledger
row, its check and its INSERT), `sums` (what a tenant spent since a time, read from the ledger file,
with the sums it keeps between calls) and `schema` (the ledger file's tables and the migration steps
between their versions). Without `tenants` in the settings none of it runs.
It may import the config's records, the root vocabulary (`proxy.errors` and the like) and the
standard library; never aiohttp, never `serving/` or `lifecycle/`: the HTTP edge reads this wing,
not the other way round (`.importlinter` checks it).
"""
