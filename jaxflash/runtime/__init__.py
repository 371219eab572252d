"""jaxflash.runtime."""
