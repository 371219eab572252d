"""jaxflash.replay."""
