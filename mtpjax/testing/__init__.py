"""Test helpers: deterministic tiny GGUF models built with the real gguf writer (no jax)."""

from mtpjax.testing.tiny_glm import (TinyGlmSpec, build_tiny_glm_tensors, stored_tiny_glm_tensors,
                                     tiny_tokenizer_metadata, write_tiny_glm_gguf)

__all__ = ["TinyGlmSpec", "build_tiny_glm_tensors", "stored_tiny_glm_tensors",
           "tiny_tokenizer_metadata", "write_tiny_glm_gguf"]
