"""ModelConfig (the decoder's shapes and per-family switches) and named presets."""
