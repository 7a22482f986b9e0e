"""A model driver's settings (one per worker), and what a model's config makes of its schedulers."""

from __future__ import annotations

from dataclasses import dataclass

from batching.plan import SchedulerConfig
from batching.policy import BatchPolicy
from fleet.admission import bulk_lane
from fleet.llm_spec import is_llm, llm_settings
from fleet.model_spec import ModelSpec
from workers.custody import CustodyConfig


@dataclass(frozen=True, slots=True)
class LoopConfig:
    block_ms: int = 1000
    read_ahead_batches: int = 3  # fleet/settings.py's
    aging_us: int = 0
    bulk_share: float = 1.0
    watchdog_s: float = 120.0
    inline_max_us: int = 5000  # workers/inline.py: the longest batch the event loop computes itself
    custody: CustodyConfig = CustodyConfig()


DEFAULT_LOOP_CONFIG = LoopConfig()


def policy_for(spec: ModelSpec, aging_us: int = 0) -> BatchPolicy:
    db = spec.dynamic_batching
    bulk = bulk_lane(spec)
    seq = spec.sequence
    if seq is not None:  # the sequence batcher's strategy batches each instance's sequences
        return BatchPolicy(max_batch_size=spec.max_batch_size, preferred_batch_sizes=seq.preferred_batch_sizes,
                           max_queue_delay_us=seq.max_queue_delay_us, dynamic=spec.max_batch_size > 0,
                           aging_us=aging_us, bulk_lane=bulk)
    if db is None or spec.max_batch_size == 0:
        return BatchPolicy(max_batch_size=spec.max_batch_size, dynamic=False, aging_us=aging_us, bulk_lane=bulk)
    return BatchPolicy(max_batch_size=spec.max_batch_size, preferred_batch_sizes=db.preferred_batch_sizes,
                       max_queue_delay_us=db.max_queue_delay_us, aging_us=aging_us, bulk_lane=bulk)


def preserves_ordering(spec: ModelSpec) -> bool:
    return spec.dynamic_batching is not None and spec.dynamic_batching.preserve_ordering


def scheduler_config(spec: ModelSpec, policy: BatchPolicy, instances: int, config: LoopConfig,
                     host_bound: bool = True) -> SchedulerConfig:
    """The scheduler of one version of `spec` with `instances` instances; `host_bound`: some of them
    compute on the host's CPU (batching.scheduler stages partial batches only where none does)."""
    # A generation engine's slots (workers/backends/llm.py): never staged, and bulk requests hold at most
    # max_running of them, so online ones always find a slot and preempt bulk inside the engine.
    llm = llm_settings(spec) if is_llm(spec) else None
    # bulk_share's pauses would hold every bulk request for seconds after each generation: the engine's
    # lane preemption already puts online first.
    share = config.bulk_share if llm is None else 1.0
    return SchedulerConfig(policy, instances, bulk_lane(spec), share, preserve_ordering=preserves_ordering(spec),
                           pinned=spec.sequence is not None, stage=llm is None, stage_partial=not host_bound,
                           bulk_instances=llm.continuous.max_running if llm else 0)
