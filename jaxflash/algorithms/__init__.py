"""jaxflash.algorithms."""
