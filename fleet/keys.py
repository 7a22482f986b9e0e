"""Every Redis key fleet uses (design.md, "Redis layout"), built from the configurable prefix.

A model's keys share the hash tag `{<model>}` so a Redis Cluster puts them on one shard.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"  # the consumer group every worker joins on every model stream


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "fleet"

    def queue(self, model: str, lane: int = 0, *, version: int) -> str:
        """Stream: one priority lane of one model version. Each version has its own streams, so a
        request naming a version only ever reaches workers that serve it, and a version drains on
        its own when it is unloaded (a worker never has to answer NOT_FOUND for another's version)."""
        return f"{self.prefix}:{{{model}}}:v{version}:q:{lane}"

    def sequence_queue(self, model: str, version: int, worker_id: str) -> str:
        """Stream: the requests of the live sequences one worker holds for a version of a sequence model,
        in order (gateway/sequences.py). It is that worker's online lane for the version: a sequence's
        state lives on one instance, so its requests cannot go to whichever worker reads first."""
        return f"{self.prefix}:{{{model}}}:v{version}:seq:{worker_id}"

    def sequence_owner(self, model: str, version: int, sequence: int | str) -> str:
        """String + TTL: the id of the worker holding a live sequence (the TTL outlasts the sequence's idle
        timeout; the worker itself releases it). Integer and string correlation ids are distinct."""
        kind = "s" if isinstance(sequence, str) else "i"
        return f"{self.prefix}:{{{model}}}:v{version}:sequence:{kind}:{sequence}"

    def sequence_workers(self, model: str, version: int) -> str:
        """Set: ids of the workers that have a sequence stream for a version (workers/sequence_reaper.py)."""
        return f"{self.prefix}:{{{model}}}:v{version}:seqworkers"

    def sequence_reaping(self, model: str, version: int, worker_id: str) -> str:
        """String + TTL: one live worker is answering what a dead one's sequence stream holds."""
        return f"{self.prefix}:{{{model}}}:v{version}:seqreap:{worker_id}"

    def dead(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dead"

    def stats(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:stats"

    def stats_log(self, model: str) -> str:
        """Stream: each executed batch's increments, as its worker wrote them beside its replies, until
        someone folds them into the stats hash (fleet/stats.py FOLD_STATS)."""
        return f"{self.prefix}:{{{model}}}:stats:log"

    def stats_tokens(self, model: str, kind: str = "") -> str:
        """String: the tokens of the stats-log entries folded in the current rotation (`kind` "old": the
        one before; "copied" and "copied:old": the same for the copies counted, whose first may still
        come), back to back, so that a batch written again after a write whose outcome was unknown counts
        once (fleet/stats.py)."""
        return f"{self.prefix}:{{{model}}}:stats:tokens{':' + kind if kind else ''}"

    def custom_metrics(self, model: str) -> str:
        """Hash: worker id -> that worker's part of the model's Python custom metrics (msgpack,
        fleet/custom_metrics.py); gateways add the parts up (gateway/custom_metrics.py)."""
        return f"{self.prefix}:{{{model}}}:custom_metrics"

    def custom_metrics_folded(self, model: str) -> str:
        """Sorted set: the parts (`<worker id>/<start token>`) a gateway folded into the hash's RETIRED
        field, scored by when; a folded part's later writes are refused, or its counts would be added
        twice."""
        return f"{self.prefix}:{{{model}}}:custom_metrics:folded"

    def reply(self, gateway_id: str) -> str:
        return f"{self.prefix}:reply:{gateway_id}"

    def job_results(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:results"

    def is_job_results(self, key: str) -> bool:
        """Whether `key` is a job's results stream (a reply to a bulk job's request)."""
        return key.startswith(f"{self.prefix}:job:") and key.endswith(":results")

    # Job records share the hash tag {jobs}: the record scripts touch a job and the indexes together,
    # which a Redis Cluster allows only within one slot. They are small; the heavy traffic of a job
    # (its results stream, its model's lane) stays spread out.
    def job(self, job_id: str) -> str:
        """Hash: a bulk job's record and progress (fleet/jobs/records.py)."""
        return f"{self.prefix}:{{jobs}}:job:{job_id}"

    def job_errors(self, job_id: str) -> str:
        """List: samples of failed items, `{"line", "error"}` JSON, capped."""
        return f"{self.prefix}:{{jobs}}:job:{job_id}:errors"

    def job_lease(self, job_id: str) -> str:
        """String + TTL: held by the one runner executing the job; its absence means nobody is."""
        return f"{self.prefix}:{{jobs}}:job:{job_id}:lease"

    def job_recovery(self, job_id: str) -> str:
        """String + TTL: one job worker is re-queueing this orphaned job; the others leave it."""
        return f"{self.prefix}:{{jobs}}:job:{job_id}:recovery"

    def jobs(self) -> str:
        """Sorted set: every job id, scored by creation time."""
        return f"{self.prefix}:{{jobs}}:index"

    def jobs_unfinished(self) -> str:
        """Set: the ids of jobs not yet completed, failed or cancelled (what recovery looks at)."""
        return f"{self.prefix}:{{jobs}}:unfinished"

    def job_states(self) -> str:
        """Hash: state -> how many jobs are in it (kept by the record scripts, read by /metrics)."""
        return f"{self.prefix}:{{jobs}}:states"

    def rq_queue(self) -> str:
        """The RQ queue name bulk jobs run on (RQ builds its own keys from it)."""
        return f"{self.prefix}-jobs"

    def models(self) -> str:
        """Hash: model control's desired state, model name -> control record JSON (fleet/model_control.py),
        written by the repository API in explicit mode; every worker reconciles to it."""
        return f"{self.prefix}:models"

    def models_gen(self) -> str:
        """Counter: the generation each load or unload call takes (so every worker tells calls apart)."""
        return f"{self.prefix}:models:gen"

    def model_configs(self, model: str) -> str:
        """Hash: generation -> the complete config (pbtxt) a worker loaded that generation with (after an
        override and auto-complete): what gateways render and validate against."""
        return f"{self.prefix}:{{{model}}}:configs"

    def model_files(self, model: str, gen: str) -> str:
        """Hash: relative path -> contents of the `file:` overrides of one load call."""
        return f"{self.prefix}:{{{model}}}:files:{gen}"

    def worker(self, worker_id: str) -> str:
        """Hash + TTL: one worker's heartbeat (what it serves, what it has queued)."""
        return f"{self.prefix}:worker:{worker_id}"

    def workers(self) -> str:
        """Sorted set: every worker id that sent a heartbeat, scored by when it expires (epoch ms): the
        registry gateways read instead of scanning the keyspace."""
        return f"{self.prefix}:workers"

    def cancel(self) -> str:
        """Pub/sub channel: `[model, request id]` of requests whose callers went away (best effort: a
        worker that misses one computes a reply nobody reads)."""
        return f"{self.prefix}:cancel"

    def control(self) -> str:
        """Pub/sub channel: a model name whose desired state changed; workers reconcile at once (they
        also re-read the desired state every few seconds, so a missed message only delays)."""
        return f"{self.prefix}:control"

    def log_settings(self) -> str:
        """Hash: the logging extension's settings changed at run time, one field per setting (JSON
        values); fields never set keep each process's own default (fleet/log_settings.py)."""
        return f"{self.prefix}:settings:logging"

    def trace_settings(self) -> str:
        """Hash: the trace extension's settings, `<scope>.<setting>` fields (JSON values), scope `global`
        or `model:<name>`, plus a `<scope>._v` counter per scope (fleet/trace_settings.py)."""
        return f"{self.prefix}:settings:trace"

    def settings_changed(self) -> str:
        """Pub/sub channel: `logging` or `trace` once that hash changed; every process re-reads it."""
        return f"{self.prefix}:settings"
