"""Settings: conf/pool.yaml deep-merged with conf/local.yaml, validated against conf/schema.json.

YAML is a superset of JSON, so an llm-pool settings.json loads unchanged, and its config/local.json
beside it is merged the same way. Every problem is reported with the exact path and the rule it
breaks, and the whole document is checked before anything starts. An unknown key is a warning with
the closest known name, never a stop (an older or newer settings file must keep the service up);
`strict` makes warnings errors.

By concern, each module importing only those listed after it (.importlinter, "config" contract):
`loading` (reading the files, their merge with the origins of each key, and building the records:
`load_settings`, `ConfigError`), `checks` (the schema's and the cross-field rules, load overrides,
replica counts), `settings` (the records of the service, supervisord, hosts, engine.lifecycle and
`Settings`, with their defaults), `model` (`ModelConfig`, one model's record, and its defaults),
`origins` (the file and line each key came from, keys given twice), `merge` (`deep_merge`, `changed`)
and `files` (where the repo's schema and default settings are). Nothing is re-exported here: import
each name from its module. Where llm-pool caches what it builds is proxy/setup/paths.py.
"""
