"""The edge of a request that needs no shared state: strict JSON, the Anthropic shapes, a stream's
relay and its counts, bounded reads of an answer. Imported by the one process's serving wing and by
a worker (proxy/worker/) alike, so nothing here imports the pool, tenancy or the app's keys
(.importlinter: the edge contract)."""
