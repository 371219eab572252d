"""jaxflash.rewards."""
