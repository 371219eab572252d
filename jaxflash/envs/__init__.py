"""jaxflash.envs."""
