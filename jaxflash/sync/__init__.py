"""jaxflash.sync."""
