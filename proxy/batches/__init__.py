"""The batches wing: what the Batch API keeps (`store`: the files on disk and, in one SQLite file,
each file's record, each batch and each of its lines with where it stands). The routes, the checks
of a file's lines and the runner that sends the lines are the HTTP edge's (proxy/serving/
routes_batches.py, batch_lines.py, batch_runner.py): this wing imports the standard library only
(`.importlinter` checks that it imports nothing above it).
"""
