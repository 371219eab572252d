"""jaxflash.sharding."""
