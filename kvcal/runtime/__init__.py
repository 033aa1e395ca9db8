"""Runtime: a transformers Cache that holds each layer's compressed state."""
