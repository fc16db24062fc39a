"""The torch engine: a Llama-style model over a paged KV pool."""
