"""Text environments and multi-turn episodes (layer 2: no generation, learner or runtime).

- ``base``: the protocol (``reset(seed) -> str``, ``step(text) -> StepResult``), limits
  (``EnvConfig``), checked calls that turn environment faults into ``EnvFailure``s.
- ``frozenlake``, ``sokoban``, ``scienceworld`` (+ ``scienceworld_sim``: pooled JVMs),
  ``tool_env`` (+ ``tool_sandbox``), ``gym_adapter``,
  ``latency``, ``registry``: environments.
- ``chat``, ``episode``, ``training``, ``driver``, ``calibration``: token-in/token-out
  episodes, their training samples and advantages, a synchronous driver, mean@n.
"""
