"""Kinds of replica: how a model's replicas start, stop and are reached, per backend.

`kind` (which kind runs each backend, and its traits), `programs` (replicas as supervisord
programs: files, ports, adoption), `remote` and `remote_files` (an OpenAI-compatible provider).
What the pool asks of a kind is a protocol declared in `state/`; this wing implements it. May import
`state/`, `proxy.upstream`, `supervisord/`, launchers and the root vocabulary; never `placement/`,
`watch/` or the pool.
"""
