"""The OpenAI-compatible HTTP shell over the live engine."""
