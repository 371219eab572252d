"""jaxflash.learner."""
