"""A worker process of service.workers > 1 (docs/workers.md): it accepts clients and relays answers;
its controller (proxy/serving/) decides everything. Nothing here imports the pool (.importlinter)."""
