"""jaxflash.generation."""
