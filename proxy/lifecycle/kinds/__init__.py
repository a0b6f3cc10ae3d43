"""Kinds of replica: how a model's replicas start, stop and are reached, per backend.

`kind` (which kind runs each backend, and its traits), `rules` (each kind's rules: config checks,
gate, admin row; all `check-config` uses), `program_kind` (the program kind's runner) over
`programs` (replicas as supervisord programs: files, adoption, removal), `ports` (which port each
program gets) and `process_table` (supervisord's processes on every host); `stale_programs` (programs of models no
longer configured, removed); `remote` (the endpoint
kind's runner and its sending) with `remote_options` (the `remote_*` fields, read once),
`provider` (URL, key, body mapping, errors) and `remote_files` (a provider's Files API).
What the pool asks of a kind is a protocol declared in `state/`; this wing implements it. May import
`state/`, `proxy.upstream`, `supervisord/`, launchers and the root vocabulary; never `placement/`,
`watch/` or the pool.
"""
