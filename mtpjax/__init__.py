"""mtpjax: JAX/Flax inference for GLM-family GGUF layer packages with a native MTP head."""

__version__ = "0.1.0"
