"""Examples written against jaxflash's public contracts (importable from the repo root)."""
