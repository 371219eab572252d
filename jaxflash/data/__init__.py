"""jaxflash.data."""
