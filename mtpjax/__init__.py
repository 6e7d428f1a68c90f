"""mtpjax: JAX/Flax inference for GLM-family GGUF layer packages with a native MTP head."""

__version__ = "0.1.0"


def load(source, **kwargs):
  """Load a layer package, GGUF or converted checkpoint; see `mtpjax.api.load`."""
  from mtpjax import api  # jax is imported only when a model is loaded
  return api.load(source, **kwargs)
