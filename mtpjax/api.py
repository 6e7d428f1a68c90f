"""`mtpjax.load(source)`: the small public API the engine, notebooks and outside checks use.

`source` is a layer package directory, a GGUF (plain or any shard of a split one) or a
checkpoint written by `python -m mtpjax.convert`. Whether native MTP runs is resolved once from
the config and the package metadata (SPECULATIVE.md); with it off, the MTP head is not loaded
until a call asks for it explicitly (`mtp_logits`, or `generate(speculative="native-mtp-n1")`).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax import checkpoint, errors, loading, runtime_options, sharding, speculative, text
from mtpjax.engine.decode import Engine, EngineConfig, pow2_bucket
from mtpjax.engine.generate import AdaptiveDrafting, Request, Result, SlotScheduler
from mtpjax.engine.sampling import MAX_TOP_LOGPROBS, SamplerParams
from mtpjax.models.config import ModelConfig, config_from_gguf
from mtpjax.models.glm4_moe import StageLayout, init_kv, previous_hidden
from mtpjax.package.manifest import parse_manifest
from mtpjax.package.reader import open_source


DEFAULT_MODEL_NAME = "glm"   # the per-model config scope when no config is given


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
  """What a converted checkpoint remembers of its source, enough to resolve the strategy."""
  kind: str
  path: pathlib.Path
  manifest: Any
  manifest_sha256: str | None
  metadata: dict
  tensors: dict
  layer_count: int


class Model:
  """A loaded model: full-sequence forwards for checks, and `generate` for decoding."""

  def __init__(self, source, cfg: ModelConfig, *, dtype: str, resolution,
               config=None, mesh=None, checkpoint_dir: pathlib.Path | None = None,
               stage_ranges: Sequence | None = None):
    self.source = source
    self.config = cfg
    self.dtype = dtype
    self.resolution = resolution
    self.run_config = config
    self.mesh = mesh
    self._checkpoint_dir = checkpoint_dir
    self._weights: dict[bool, tuple] = {}
    self._engines: dict[tuple, Engine] = {}
    # The resolved flag, carried unchanged to the loader, every stage and the server.
    engine = config.engine if config is not None else None
    self.load_options, self.stage_configs, self.generation_settings = (
        runtime_options.consumers_from_resolution(
            resolution, dtype=dtype, stage_ranges=stage_ranges or [(0, source.layer_count)],
            max_len=engine.max_len if engine else 512, slots=engine.slots if engine else 1,
            prefill_buckets=engine.prefill_buckets if engine else (16, 32, 64, 128, 256),
            timing=engine.timing if engine else False))
    self.weights(with_mtp=self.load_options.native_mtp)

  @property
  def has_mtp(self) -> bool:
    return self.config.has_mtp

  @property
  def mtp_head_loaded(self) -> bool:
    """Whether the MTP head's weights are in memory (loaded at start only when MTP is on)."""
    return True in self._weights and self.has_mtp

  @property
  def metadata(self) -> dict:
    return self.source.metadata

  @functools.cached_property
  def tokenizer(self) -> text.Tokenizer:
    """encode / decode / apply_chat_template, from the model's GGUF metadata."""
    return text.Tokenizer.from_metadata(self.metadata, path=str(self.source.path))

  def generate_text(self, prompt, **kwargs) -> text.TextResult:
    """Text (or chat messages) in, text out; see `mtpjax.text.generate_text`."""
    return text.generate_text(self, prompt, **kwargs)

  def chat(self, messages, **kwargs) -> text.TextResult:
    """The assistant's reply to chat messages; see `mtpjax.text.chat`."""
    return text.chat(self, messages, **kwargs)

  # --- weights ------------------------------------------------------------------------------

  def weights(self, *, with_mtp: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the whole model, with or without the MTP head."""
    with_mtp = with_mtp and self.has_mtp
    if with_mtp not in self._weights:
      if self._weights and with_mtp:
        self._weights.clear()       # the MTP-on weights include everything the others hold
      layout = StageLayout.whole(self.config, mtp=with_mtp)
      sharding_fn = sharding.param_sharding_fn(self.mesh) if self.mesh is not None else None
      self._weights[with_mtp] = self._load_layout(layout, sharding_fn)
    return self._weights[with_mtp]

  def _load_layout(self, layout: StageLayout, sharding_fn) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of one layout, from the checkpoint parts or streamed from the source."""
    if self._checkpoint_dir is not None:
      graphdef, abstract = loading.abstract_model(self.config, layout, self.dtype)
      leaves = checkpoint.restore_leaves(self._checkpoint_dir, layout,
                                         loading.flat_paths(abstract), sharding_fn)
      return loading.assemble(graphdef, abstract, leaves)
    return loading.load_state(self.source, self.config, layout, dtype=self.dtype,
                              sharding_fn=sharding_fn)

  def _any_weights(self):
    return next(iter(self._weights.values()))

  # --- full-sequence forwards ---------------------------------------------------------------

  @functools.cached_property
  def _jit_hidden(self):
    def run(graphdef, state, tokens):
      model = nnx.merge(graphdef, state)
      positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
      kv = init_kv(self.config, self.config.n_layers, 1, tokens.shape[1], model.dtype)
      hidden, _ = model.forward(tokens, positions, kv)
      return hidden, model.lm_logits(hidden)
    return jax.jit(run, static_argnums=0)

  @functools.cached_property
  def _jit_mtp(self):
    def run(graphdef, state, tokens, prev_hidden):
      model = nnx.merge(graphdef, state)
      positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
      mtp_kv = init_kv(self.config, 1, 1, tokens.shape[1], model.dtype)[0]
      z, _ = model.mtp_hidden(tokens, prev_hidden, positions, mtp_kv)
      return model.mtp_logits(z)
    return jax.jit(run, static_argnums=0)

  def _padded(self, token_ids) -> tuple[jax.Array, int]:
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    padded = np.zeros((1, pow2_bucket(ids.size)), np.int32)
    padded[0, :ids.size] = ids
    return jnp.asarray(padded), ids.size

  def _trunk(self, token_ids, weights=None):
    graphdef, state = weights or self._any_weights()
    tokens, n = self._padded(token_ids)
    hidden, logits = self._jit_hidden(graphdef, state, tokens)
    return tokens, n, hidden, logits

  def logits(self, token_ids) -> np.ndarray:
    """[T, vocab] logits of a causal forward over positions 0..T-1."""
    _, n, _, logits = self._trunk(token_ids)
    return np.asarray(logits[0, :n], np.float32)

  def hidden(self, token_ids) -> np.ndarray:
    """[T, hidden] trunk output after the final norm (what the head and the MTP head see)."""
    _, n, hidden, _ = self._trunk(token_ids)
    return np.asarray(hidden[0, :n], np.float32)

  def mtp_logits(self, token_ids) -> np.ndarray:
    """[T, vocab]: row k = token ids[k] at position k with hidden row k-1 (zero for row 0)."""
    if not self.has_mtp:
      raise errors.SpeculativeConfigError(
          "this model has no NextN (MTP) block", path=str(self.source.path),
          field="blk.N.nextn.*", remedy="use a GGUF or package that includes the MTP head")
    weights = self.weights(with_mtp=True)
    tokens, n, hidden, _ = self._trunk(token_ids, weights)
    prev = previous_hidden(hidden)
    return np.asarray(self._jit_mtp(weights[0], weights[1], tokens, prev)[0, :n], np.float32)

  # --- decoding -----------------------------------------------------------------------------

  def resolve(self, requested: str | None):
    """The strategy for one call: None keeps the load-time resolution."""
    if requested is None:
      return self.resolution
    canonical = speculative.normalize_strategy(requested, "generate(speculative=...)")
    return speculative.resolve_speculative(
        model_id=self.resolution.model_id, requested=canonical,
        scope="generate(speculative=...)", source_kind=self.source.kind,
        manifest=self.source.manifest, layer_count=self.source.layer_count,
        gguf_metadata=self.source.metadata, tensor_names=self.source.tensors.keys(),
        source_path=str(self.source.path))

  def engine(self, *, native_mtp: bool, slots: int = 1, max_len: int = 512,
             prefill_buckets: Sequence[int] | None = None, timing: bool = False,
             logprobs: int = 0) -> Engine:
    """A compiled engine, cached by its settings so repeated calls reuse the compiled steps."""
    buckets = tuple(prefill_buckets) if prefill_buckets else tuple(
        b for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if b <= max_len + 2)
    engine_cfg = EngineConfig(slots=slots, max_len=max_len, prefill_buckets=buckets,
                              native_mtp=native_mtp, timing=timing, logprobs=logprobs)
    if engine_cfg not in self._engines:
      self._engines[engine_cfg] = self._make_engine(engine_cfg)
    return self._engines[engine_cfg]

  def _make_engine(self, engine_cfg: EngineConfig) -> Engine:
    graphdef, state = self.weights(with_mtp=engine_cfg.native_mtp)
    return Engine(graphdef, state, self.config, engine_cfg,
                  dtype=loading.resolve_dtype(self.dtype))

  def generate(self, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_ids=(),
               speculative: str | None = None, timing: bool = False,
               adaptive_drafting: bool = True, logprobs: bool = False) -> Result:
    """Decode one prompt; `Result.tokens` and `Result.stats` (MTP counters).

    `logprobs`: `Result.logprobs` holds each token's logprob and top MAX_TOP_LOGPROBS.

    With `adaptive_drafting`, MTP pauses while its drafts keep being rejected (see
    `AdaptiveDrafting`); the tokens are the same either way.
    """
    native_mtp = (self.generation_settings.native_mtp if speculative is None
                  else self.resolve(speculative).native_mtp)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    max_len = max(128, pow2_bucket(prompt.size + max_new_tokens + 1))
    engine = self.engine(native_mtp=native_mtp, max_len=max_len, timing=timing,
                         logprobs=MAX_TOP_LOGPROBS if logprobs else 0)
    request = Request(prompt=prompt, max_new_tokens=int(max_new_tokens),
                      sampler=SamplerParams(temperature, top_k, top_p, seed),
                      stop_ids=frozenset(int(t) for t in stop_ids), logprobs=logprobs)
    policy = AdaptiveDrafting() if adaptive_drafting else None
    return SlotScheduler(engine, adaptive=policy).run([request])[0]


def _open(source_path):
  """(source, cfg, checkpoint dir or None) for a package, GGUF or converted checkpoint."""
  path = pathlib.Path(source_path)
  if checkpoint.is_checkpoint(path):
    record = checkpoint.read_record(path)
    src = record["source"]
    manifest = (parse_manifest(src["manifest"], path=src["path"])
                if src["manifest"] is not None else None)
    source = CheckpointSource(
        kind=src["kind"], path=path, manifest=manifest, manifest_sha256=src["manifest_sha256"],
        metadata=record["metadata"], tensors={n: None for n in src["tensor_names"]},
        layer_count=src["layer_count"])
    return source, ModelConfig.from_dict(record["model_config"]), path
  source = open_source(path)
  return source, config_from_gguf(source.metadata, source.tensors, source=str(path)), None


def load(source, *, dtype: str = "float32", stages: int = 1, splits=None, config=None,
         mesh=None) -> Model:
  """Open `source`, resolve the speculative strategy and load the weights."""
  loading.resolve_dtype(dtype)
  mesh_cfg = config.mesh if config is not None else None
  if (stages != 1 or splits is not None
      or (mesh_cfg is not None and (mesh_cfg.stages != 1 or mesh_cfg.splits is not None))):
    from mtpjax.engine import pipeline_model  # imports this module
    return pipeline_model.load_pipelined(source, dtype=dtype, stages=stages, splits=splits,
                                         config=config)
  if mesh is None and mesh_cfg is not None and mesh_cfg.tensor != 1:
    mesh = sharding.make_mesh(stages=1, tensor=mesh_cfg.tensor)   # fails before any I/O
  src, cfg, checkpoint_dir = _open(source)
  model_name = config.model.name if config is not None else DEFAULT_MODEL_NAME
  resolution = speculative.resolve_for_source(config or {}, model_name, src)
  return Model(src, cfg, dtype=dtype, resolution=resolution, config=config, mesh=mesh,
               checkpoint_dir=checkpoint_dir)
