"""The study's training progress: a tqdm bar on a terminal, else a line at a steady interval."""

from __future__ import annotations

import sys
import time

PROGRESS_EVERY = 30.0  # seconds between progress lines when stderr is not a terminal


class Progress:
    """A tqdm bar on a terminal, else one line every PROGRESS_EVERY seconds (a Heartbeat's interval
    rule, normswap/progress.py; the line is built only when it is due)."""

    def __init__(self, total: int, show_bar: bool, echo):
        from normswap.progress import Heartbeat

        self.total, self.done = total, 0
        self.heartbeat = Heartbeat(echo, every=PROGRESS_EVERY, enabled=True, clock=time.perf_counter)
        self.bar = None
        if show_bar:
            from tqdm.auto import tqdm

            from normswap.progress import unescaped

            self.bar = tqdm(total=total, desc="study", unit="arm-step", dynamic_ncols=True, file=unescaped(sys.stderr))

    def step(self, n: int, where: str, arms) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(where)
            return
        done, beat = self.done, self.heartbeat

        def line() -> str:
            losses = "  ".join(
                f"{a.name} {a.record['loss'][-1]:.3f}"
                for a in arms
                if a.record["loss"] and a.record["loss"][-1] is not None
            )
            elapsed = beat.clock() - beat.t0
            left = elapsed / max(done, 1) * (self.total - done)
            return (
                f"study: {where}  {done}/{self.total} arm-steps  loss {losses}  ({elapsed:.0f} s, ~{left:.0f} s left)"
            )

        beat.update(line)

    def close(self):
        if self.bar is not None:
            self.bar.close()
