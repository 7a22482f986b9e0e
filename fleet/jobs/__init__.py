"""Bulk jobs, the part that runs in `fleet jobs-worker` and is shared with the gateway's /v2/jobs.

    runner.py    the RQ job function: one run of a job under its lease (JobOptions, JobRunner)
    feed.py      the send / collect / write loop: window, lost-reply resends, progress, cancel
    formats.py   readers, packing and writers (inputs.py, jsonl_input.py, items.py, packing.py, outputs.py,
                 jsonl_output.py, sink.py; a JSONL line as an item: lines.py, line_heads.py)
    parse_pool.py  a JSONL job's lines parsed by forked helpers, in order (parse_child.py the helper's side,
                 parse_wire.py the frames and items on their pipes)
    records.py   job records in Redis (JobStore): state, progress, error samples
    rq_setup.py  every RQ Queue/Worker/fetch, JSON serializer only
    recovery.py  queueing runs, and re-queueing jobs whose runner died (the janitor)
    worker.py    the `fleet jobs-worker` entry point: RQ worker + janitor, outlives Redis outages

The gateway keeps only what its process runs (gateway/jobs/: the HTTP routes, the service that
validates and enqueues jobs, and the upload decoder that bounds and decompresses uploads) and imports
the shared pieces from here.
"""
