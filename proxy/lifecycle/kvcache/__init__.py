"""Swaps that keep the cache (issue 33): llama-server slots saved before their model is unloaded by
the pool and restored into its next replicas before they serve (README: KV cache across swaps)."""
