"""Bring your own agent (``envs.agent_contract``): the OpenAI-compatible endpoint
(``endpoint``), its sessions and the agents' threads (``sessions``), and the host that
builds them for a run (``host``)."""
