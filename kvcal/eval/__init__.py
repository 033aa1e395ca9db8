"""Evaluation: perplexity under both protocols, and the simulation handler it runs through."""
