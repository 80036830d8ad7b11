"""The engine's CPU thread count follows the cores other processes leave free."""

from __future__ import annotations

import time

import torch

from minisgl.engine.cpu_threads import CpuThreads, busy_seconds, own_seconds


class FakeMachine:
    """Two CPUs; each `advance` spends `ours` and `others` CPU-seconds per second for `dt`."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def advance(self, dt: float, ours: float, others: float) -> None:
        self.now += dt
        self.own += ours * dt
        self.busy += (ours + others) * dt


def _governor(machine: FakeMachine) -> CpuThreads:
    return CpuThreads(
        2,
        cpus=frozenset({0, 1}),
        read_busy=lambda cpus: machine.busy,
        read_own=lambda: machine.own,
        clock=lambda: machine.now,
        background=False,
    )


def _reading(governor: CpuThreads, machine: FakeMachine, ours: float, others: float) -> int:
    machine.advance(0.25, ours, others)
    governor.sample()
    return governor.update()


def test_one_busy_core_drops_a_thread_and_a_quiet_one_brings_it_back() -> None:
    saved = torch.get_num_threads()
    machine = FakeMachine()
    governor = _governor(machine)
    assert governor.update() == 2
    # Another process spins on one core (ours get 4/3 of a core, it 2/3): down at once.
    assert _reading(governor, machine, ours=4 / 3, others=2 / 3) == 1
    assert torch.get_num_threads() == 1
    # Still busy, or idle beside the busy core: one thread stays.
    assert _reading(governor, machine, ours=1.0, others=1.0) == 1
    assert _reading(governor, machine, ours=0.0, others=1.0) == 1
    # A short lull elsewhere (one reading) does not bring it back; a quiet machine (two) does.
    assert _reading(governor, machine, ours=1.0, others=0.0) == 1
    assert _reading(governor, machine, ours=1.0, others=0.0) == 2
    assert torch.get_num_threads() == 2
    # Light load beside us (the server's own helpers) keeps both threads.
    for _ in range(3):
        assert _reading(governor, machine, ours=1.8, others=0.2) == 2
    torch.set_num_threads(saved)


def test_fixed_counts_never_move() -> None:
    saved = torch.get_num_threads()
    fixed = CpuThreads(2, adaptive=False, cpus=frozenset({0, 1}))
    fixed.sample()
    assert fixed.update() == 2 and not fixed.adaptive
    single = CpuThreads(1, cpus=frozenset({0, 1}))
    assert single.update() == 1 and not single.adaptive
    torch.set_num_threads(saved)


def test_the_readings_of_this_machine() -> None:
    cpus = frozenset({0})
    first, own = busy_seconds(cpus), own_seconds()
    assert first is not None and first >= 0.0 and own > 0.0
    # Spend CPU time of our own until the clock (10 ms ticks) moves: a fixed amount of work can
    # finish inside one tick on a fast core.
    deadline = time.monotonic() + 5.0
    while own_seconds() <= own and time.monotonic() < deadline:
        sum(i * i for i in range(100_000))
    assert own_seconds() > own and busy_seconds(cpus) >= first


def test_an_engine_beside_a_busy_core_computes_on_fewer_threads_and_equals_hf() -> None:
    """A process spinning on one of this process's CPUs: the engine drops a thread within a
    few readings (the C kernels at once), and its greedy tokens still equal HF's."""
    import os
    import subprocess
    import sys
    import time

    from helpers import MIXED_PROMPTS, build_llm, greedy, hf_greedy

    from minisgl.env import ENV

    saved = torch.get_num_threads()
    cpus = sorted(os.sched_getaffinity(0))
    busy_cpu = cpus[-1]
    spinner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {busy_cpu}),
    )
    previous, ENV.ADAPTIVE_THREADS.value = ENV.ADAPTIVE_THREADS.value, True
    try:
        llm = build_llm("qwen3", max_running_req=4)
        governor = llm.engine.cpu_threads
        assert governor is not None and governor.max_threads == len(cpus)
        assert governor.adaptive == (len(cpus) > 1)
        deadline = time.monotonic() + 10.0
        while governor.adaptive and governor.wanted == len(cpus) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for readings, not timing anything
        if governor.adaptive:
            assert governor.wanted < len(cpus), "a busy core must cost the engine a thread"
        outputs = llm.generate(MIXED_PROMPTS, greedy(6))
        assert [o["token_ids"] for o in outputs] == hf_greedy("qwen3", MIXED_PROMPTS, 6)
        llm.shutdown()
    finally:
        ENV.ADAPTIVE_THREADS.value = previous
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(saved)
