"""Tenants: who calls the data plane (`keys`), what each may still spend (`limits`) and what each
spent (`ledger`, a SQLite file). Without `tenants` in the settings none of it runs.

May import the config's records, the root vocabulary (errors) and the standard library; never
aiohttp, serving/ or lifecycle/.
"""
