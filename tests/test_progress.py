"""Progress everywhere (normswap/progress.py): where output is not a terminal, long commands print a
line at a steady interval. A fake clock and injected intervals, never sleeps."""

from __future__ import annotations


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_said_lines_come_at_once_and_silence_is_filled_at_the_interval():
    from normswap.progress import Heartbeat

    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, every=10.0, enabled=True, clock=clock)
    beat.say("perplexity: healed")
    assert lines == ["perplexity: healed"]
    clock.now += 9.9
    assert beat.tick() is None  # not yet: the interval runs from the last line
    clock.now += 0.2
    assert beat.tick() == "still: perplexity: healed (10 s)" and lines[-1] == "still: perplexity: healed (10 s)"
    assert beat.tick() is None  # once per interval, not once per tick
    clock.now += 10
    assert beat.tick() == "still: perplexity: healed (20 s)"
    beat.say("speed: repeat 1/5")  # a new line restarts the interval
    clock.now += 5
    assert beat.tick() is None and lines[-1] == "speed: repeat 1/5"


def test_step_updates_print_once_per_interval_with_the_loss_read_when_due():
    from normswap.progress import Heartbeat, StepProgress

    class Log:  # a RunDir's rows(), counted to show it is read only for lines that are printed
        reads = 0

        def rows(self):
            Log.reads += 1
            return [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 101)]

    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, every=10.0, enabled=True, clock=clock)
    hook = StepProgress(Log(), 100, beat.update, clock=clock)
    for step in range(1, 101):
        clock.now += 0.5  # 0.5 s per step: 50 s in all
        hook(step)
    assert len(lines) == 5, lines  # one line per 10 s, not one per step
    assert lines[0] == "step 20/100  loss 3.000  (10 s, ~40 s left)"
    assert Log.reads == 5


def test_a_terminal_gets_no_repeats_and_a_log_does(monkeypatch):
    import sys

    from normswap.progress import Heartbeat

    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    monkeypatch.setattr(sys, "stderr", Stream(True))
    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, every=10.0, clock=clock)
    beat.say("convert: verifying")
    clock.now += 60
    assert not beat.enabled and beat.tick() is None and lines == ["convert: verifying"]
    monkeypatch.setattr(sys, "stderr", Stream(False))  # control: a log file, CI, nohup
    beat = Heartbeat(lines.append, every=10.0, clock=clock)
    beat.say("convert: verifying")
    clock.now += 60
    assert beat.enabled and beat.tick() == "still: convert: verifying (60 s)"


def test_finetune_prints_progress_lines_when_not_a_terminal(tmp_path, run_cli, monkeypatch):
    from normswap import progress

    monkeypatch.setattr(progress, "EVERY", 0.0)  # every step is due: the wiring, not the clock, is under test
    code, _, err = run_cli(
        "finetune",
        "normswap:kjv-gpt2",
        tmp_path / "ft",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--eval-tokens",
        "256",
        "--device",
        "cpu",
    )
    assert code == 0, err
    steps = [ln for ln in err.splitlines() if ln.startswith("normswap finetune: step ")]
    assert [ln.split("  ")[0] for ln in steps] == [f"normswap finetune: step {i}/3" for i in (1, 2, 3)], err
    # control: with the bar forced on (as in a terminal) there are no progress lines
    code, _, err = run_cli(
        "finetune",
        "normswap:kjv-gpt2",
        tmp_path / "ft2",
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--eval-tokens",
        "256",
        "--device",
        "cpu",
        "--progress",
    )
    assert code == 0 and not [ln for ln in err.splitlines() if ln.startswith("normswap finetune: step ")]
