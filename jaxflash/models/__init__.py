"""jaxflash.models."""
