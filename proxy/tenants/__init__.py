"""The tenants wing: who calls, what each may use, and what each spent.

`ledger` (the usage ledger and the minted keys: the `Ledger` protocol and its SQLite store),
`sums` (what a tenant spent since a time, read from the file, with the sums it keeps between calls)
and `schema` (the ledger file's tables and the migration steps between their versions).
It may import the root vocabulary (`proxy.errors` and the like) and the standard library; never
aiohttp, never `serving/` or `lifecycle/`: the HTTP edge reads this wing, not the other way round
(`.importlinter` checks it).
"""
