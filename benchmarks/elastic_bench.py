"""Elastic training and tiered checkpoints: what a failure costs, measured on real runs.

    python benchmarks/elastic_bench.py [--steps 600] [--fail-at 37] [--repair 90] [--quick]

One job (`shardwise train`, a tiny random Llama, 2 data-parallel replicas on local processes, each
replica pinned to a CPU core of its own: the capacity a node brings) and one failure schedule: every rank is killed with SIGKILL when step --fail-at completes (a node
lost), and the lost capacity comes back --repair seconds later.

1. Tiers. Single tier (shared checkpoints every --shared-every steps) against tiered (plus a
   node-local checkpoint every --local-every steps), the job restarted at once in the same
   layout; and tiered with the local tier lost with its node. Printed: the step it resumed from,
   the steps done twice, the time from relaunch to the first new step, and the work lost per
   failure = steps done twice × step time + time to resume.
2. Fixed size against elastic. Fixed size waits for the capacity (--repair seconds), then
   restarts at 2 replicas. Elastic restarts at once at 1 replica (the same global batch, so the
   same loss curve), and when the capacity is back stops with SIGTERM (a shared checkpoint is
   saved) and restarts at 2 replicas. Printed: steps done --repair + --after seconds after the
   failure, and the losses of both against the uninterrupted run.

Everything runs in this one invocation; the uninterrupted run is the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _text(n_lines: int = 2000) -> str:
    rnd = random.Random(0)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew potent "
             "elixirs under the pale moon").split()
    return "\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(n_lines))


class Job:
    """The job's fixed options; `start` launches it in a layout and streams its step records."""

    def __init__(self, work: Path, args):
        self.work, self.args = work, args

    def command(self, ckdir: Path, replicas: int, tiered: bool) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "shardwise", "train", "--model", str(self.work / "model"),
               "--data", str(self.work / "data.txt"), "--checkpoint-dir", str(ckdir / "shared"),
               "--checkpoint-every", str(a.shared_every), "--steps", str(100 * a.steps),
               "--data-parallel", str(replicas), "--batch-size", "8", "--seq-len", "64",
               "--lr", "1e-3", "--seed", "7", "--json"]
        if tiered:
            cmd += ["--local-checkpoint-dir", str(ckdir / "local"), "--local-checkpoint-every", str(a.local_every)]
        return cmd

    def start(self, ckdir: Path, replicas: int, tiered: bool) -> "Run":
        # A replica's capacity is one CPU core here: a job short of a node is short of its compute
        # (without the pin, one process on two cores outruns two that all-reduce).
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:replicas])
        cmd = ["taskset", "-c", cores, *self.command(ckdir, replicas, tiered)]
        return Run(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True))


class Run:
    def __init__(self, proc: subprocess.Popen):
        self.proc, self.t0, self.records = proc, time.monotonic(), []

    def next_record(self) -> dict | None:
        line = self.proc.stdout.readline()
        if not line:
            return None
        rec = json.loads(line)
        rec["t"] = time.monotonic()
        self.records.append(rec)
        return rec

    def until(self, step: int | None = None, deadline: float | None = None) -> None:
        """Read records until `step` is done, `deadline` (monotonic) has passed, or the run ends."""
        while True:
            rec = self.next_record()
            if rec is None or (step is not None and rec["step"] >= step) or \
                    (deadline is not None and rec["t"] >= deadline):
                return

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, as a pod's deletion sends: the ranks save a shared checkpoint and exit."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.until()
        self.proc.wait()

    @property
    def first_step_after_start(self) -> float:
        return self.records[0]["t"] - self.t0


def _step_time(records: list[dict]) -> float:
    gaps = [b["t"] - a["t"] for a, b in zip(records, records[1:])]
    return statistics.median(gaps[1:] or gaps)


def tiers(job: Job, work: Path, fail_at: int, baseline: dict[int, float]) -> None:
    print(f"\n1. a node lost when step {fail_at} is done; restarted at once in the same layout")
    print(f"  {'checkpoints':<36}{'resumed':>8}{'redone':>8}{'redone work':>13}{'to resume':>11}{'work lost':>11}  losses")
    for name, tiered, lose_local in (("shared only", False, False), ("tiered, local tier kept", True, False),
                                     ("tiered, local tier lost with node", True, True)):
        ckdir = work / name.replace(" ", "-").replace(",", "")
        first = job.start(ckdir, 2, tiered)
        first.until(step=fail_at)
        first.kill()
        if lose_local:
            shutil.rmtree(ckdir / "local", ignore_errors=True)
        second = job.start(ckdir, 2, tiered)
        second.until(step=fail_at + 3)
        second.kill()
        resumed = second.records[0]["step"] - 1
        step_s = _step_time(second.records)
        redone = fail_at - resumed
        lost = redone * step_s + second.first_step_after_start
        same = _same(first.records + second.records, baseline)
        print(f"  {name:<36}{resumed:>8}{redone:>8}{redone * step_s:>12.2f}s{second.first_step_after_start:>10.1f}s"
              f"{lost:>10.1f}s  {same}")
    print("  (redone work = steps done twice x the step time; to resume = relaunch to the first new step,\n"
          "   mostly process start and model load here; work lost = the two together)")


def elastic(job: Job, work: Path, fail_at: int, repair: float, after: float, baseline: dict[int, float],
            baseline_records: list[dict]) -> None:
    print(f"\n2. a node lost when step {fail_at} is done, back {repair:.0f} s later; steps done "
          f"{repair + after:.0f} s after the failure")
    results = {}
    for name in ("fixed size (waits)", "elastic (1 replica, then 2)"):
        ckdir = work / name.split()[0]
        run = job.start(ckdir, 2, False)
        run.until(step=fail_at)
        run.kill()
        failed = time.monotonic()
        runs = [run]
        if name.startswith("fixed"):
            time.sleep(repair)
        else:
            shrunk = job.start(ckdir, 1, False)
            shrunk.until(deadline=failed + repair)
            shrunk.stop()
            runs.append(shrunk)
        wide = job.start(ckdir, 2, False)
        wide.until(deadline=failed + repair + after)
        done = max(r["step"] for r in wide.records) if wide.records else fail_at
        wide.kill()
        runs.append(wide)
        records = [r for x in runs for r in x.records]
        results[name] = done
        print(f"  {name:<30} at step {done:>4} ({done - fail_at:+d} since the failure)   {_same(records, baseline)}")
    fixed, grown = results.values()
    print(f"  elastic - fixed size: {grown - fixed:+d} steps (an uninterrupted job does one every "
          f"{_step_time(list(baseline_records)) * 1000:.0f} ms)")


def _same(records: list[dict], baseline: dict[int, float]) -> str:
    """Every step's last logged loss against the uninterrupted run's: the largest relative gap,
    and how far the runs agree to 1e-3 (data-parallel degrees sum in another order, and a small
    model at a high learning rate amplifies that over hundreds of steps)."""
    last = {r["step"]: r["loss"] for r in records if r["step"] in baseline}
    gap = {s: abs(v - baseline[s]) / abs(baseline[s]) for s, v in sorted(last.items())}
    worst = max(gap, key=gap.get)
    within = next((s - 1 for s, g in gap.items() if g > 1e-3), max(gap))
    return (f"losses vs uninterrupted: within 1e-3 to step {within}, max gap {gap[worst]:.1e} "
            f"(step {worst} of {len(last)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600,
                    help="steps of the uninterrupted run the others are compared with (the job itself is "
                         "longer: every run is cut off)")
    ap.add_argument("--fail-at", type=int, default=37)
    ap.add_argument("--shared-every", type=int, default=20)
    ap.add_argument("--local-every", type=int, default=2)
    ap.add_argument("--repair", type=float, default=90.0, help="seconds until the lost capacity is back")
    ap.add_argument("--after", type=float, default=30.0, help="seconds counted after the repair")
    ap.add_argument("--quick", action="store_true", help="a short check that the script works")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.fail_at, args.shared_every, args.repair, args.after = 200, 13, 10, 20.0, 15.0

    from shardwise.worker.weights.tiny import write_tiny_model
    work = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    (work / "data.txt").write_text(_text())
    write_tiny_model(work / "model", _text(300))
    job = Job(work, args)
    print(f"{os.cpu_count()} CPU cores; tiny model, 2 data-parallel replicas (local processes, gloo), "
          f"batch 8 x 64; shared checkpoint every {args.shared_every} steps, local every {args.local_every}")
    t0 = time.monotonic()
    base = job.start(work / "uninterrupted", 2, False)
    base.until(step=args.steps)
    base.kill()
    baseline = {r["step"]: r["loss"] for r in base.records}
    print(f"uninterrupted run: {args.steps} steps in {base.records[-1]['t'] - base.t0:.1f} s, "
          f"step {_step_time(base.records) * 1000:.0f} ms, start to first step {base.first_step_after_start:.1f} s")
    tiers(job, work, args.fail_at, baseline)
    elastic(job, work, args.fail_at, args.repair, args.after, baseline, base.records)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
