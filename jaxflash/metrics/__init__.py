"""jaxflash.metrics."""
