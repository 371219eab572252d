"""A discrete-event simulator of the RL runtime at scales this machine cannot run.

The real ``RolloutScheduler`` (admission, dispatch, group buffer, staleness gate,
ledger) runs unchanged under a ``VirtualClock`` against simulated generation
servers (continuous batching over K slots; decode step and prefill costs from a
``CostModel`` fitted to our engine, or assumed for an accelerator) and a
simulated learner (time per trained token, weight-sync time). No threads.

    from jaxflash.runtime.simulate import CostModel, SimConfig, SimWorkload, LogNormal, simulate
    costs = CostModel.load("benchmarks/sim_costs/cpu_tiny_smollm2.json")
    work = SimWorkload(lengths=LogNormal(median=2000, sigma=0.8), max_tokens=8192, prompt_sigma=0.5)
    res = simulate(SimConfig(placement="disjoint", async_ratio=2, servers=8,
                             slots_per_server=32, learner_devices=8,
                             batch_prompts=32, group_size=8, steps=8), costs, work)
    res.samples_per_s, res.staleness_mean, res.bound_s_per_sample

Extension points: ``SimWorkload(episode=multi_turn(...))`` for agentic episodes (an
environment latency per turn, the slot freed meanwhile); ``SimConfig.replay_ratio``
for replayed samples trained per fresh one; ``CostModel.contention`` for shared
hardware. See docs/SIMULATION.md.

``simulate.forecast`` (with ``simulate.plan_costs``) builds a cost model from a dry run's
compiled TPU programs (roofline times) and forecasts trained samples/s over a slice's
learner/generation splits (docs/TPU.md "The forecast").

``simulate.episodes`` runs the real environment manager (every episode its own
loop, redundancy, env faults) in virtual time against real environments, with or
without a batch barrier (docs/ASYNC.md "Agentic environments").
"""

from jaxflash.runtime.simulate.barrier import RoundBarrier
from jaxflash.runtime.simulate.costs import (
    Contention,
    CostModel,
    DecodeCost,
    LearnerCost,
    PrefillCost,
    RewardCost,
    SyncCost,
)
from jaxflash.runtime.simulate.driver import SimConfig, simulate
from jaxflash.runtime.simulate.metrics import SimResult, roll_flash_bound
from jaxflash.runtime.simulate.server import SimServer
from jaxflash.runtime.simulate.workload import (
    Geometric,
    LogNormal,
    Mixture,
    Replay,
    SimWorkload,
    Turn,
    multi_turn,
    reasoning_workload,
)

__all__ = [
    "Contention",
    "CostModel",
    "DecodeCost",
    "Geometric",
    "LearnerCost",
    "LogNormal",
    "Mixture",
    "PrefillCost",
    "Replay",
    "RewardCost",
    "RoundBarrier",
    "SimConfig",
    "SimResult",
    "SimServer",
    "SyncCost",
    "Turn",
    "SimWorkload",
    "multi_turn",
    "reasoning_workload",
    "roll_flash_bound",
    "simulate",
]
