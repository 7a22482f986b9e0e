"""Garbage-collector settings for long-running serving processes.

After start-up (models loaded, app built) everything alive is long-lived: freezing it keeps the
collector from rescanning it on every full collection, which otherwise shows up as multi-ms pauses in
the latency tail. A larger first-generation threshold makes collections rarer on the request path.
"""

from __future__ import annotations

import gc


def freeze_after_startup(gen0_threshold: int = 20_000) -> None:
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
