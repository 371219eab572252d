"""jaxflash.checkpoint."""
