"""Golden-bundle generation: the bundle's model, the goldens, the bf16 profile's derivation, the writer (`kdtr gen`)."""
