"""Agents written against the stock ``openai`` client (``jaxflash.envs.agent_contract``)."""
