"""`mtpjax.load(source)`: the small public API the engine, notebooks and outside checks use.

`source` is a layer package directory, a GGUF (plain or any shard of a split one) or a
checkpoint written by `python -m mtpjax.convert`. Whether native MTP runs is resolved once from
the config and the package metadata (docs/SPECULATIVE.md); with it off, the MTP head is not loaded
until a call asks for it explicitly (`mtp_logits`, or `generate(speculative="native-mtp-n1")`).

A model runs as the stages of a plan: one stage owning everything (a single device, or a
tensor-sharded mesh), or a pipeline (`PipelinedModel`, `load(..., stages=N)`) where each process
loads and runs only the stages whose devices it owns, and results the host reads are shared
from the last stage to every process. Everything here works the same for both.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from mtpjax import checkpoint, errors, loading, runtime_options, sharding, speculative, text
from mtpjax.draft_window import DraftWindow
from mtpjax.engine.composite import HostDrafting
from mtpjax.engine.contract import EngineConfig, kv_dtype, pow2_bucket
from mtpjax.engine.drafting_policy import AdaptiveDrafting
from mtpjax.engine.engine import Engine
from mtpjax.engine.pipeline_hops import LocalHops
from mtpjax.engine.plan import PipelinePlan, make_hops, pipeline_mesh, plan_pipeline, \
    selection_like
from mtpjax.engine.sampling import MAX_TOP_LOGPROBS, SamplerParams
from mtpjax.engine.scheduler import Request, Result, SlotScheduler
from mtpjax.engine.steps import fresh_forward, fresh_mtp_rows
from mtpjax.kernels import backend
from mtpjax.models import quantized, registry
from mtpjax.models.config import ModelConfig
from mtpjax.models.interface import StageLayout, previous_hidden
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
  tensor_types: dict
  weights: str


class Model:
  """A loaded model on one stage: full-sequence forwards for checks, `generate` for decoding."""

  def __init__(self, source, cfg: ModelConfig, *, dtype: str, resolution,
               config=None, mesh=None, checkpoint_dir: pathlib.Path | None = None,
               weights: str = "quantized", int8_activations: bool = True,
               kernels: backend.Kernels | None = None):
    self.source = source
    self.config = cfg
    self.dtype = dtype
    self.weight_mode = weights      # "quantized" | "dense" (loading.WEIGHTS)
    self.int8_activations = bool(int8_activations)
    self.kernels = kernels or backend.default()   # what every forward and step runs on
    self.resolution = resolution
    self._run_config = config
    self.mesh = mesh if mesh is not None else sharding.make_mesh(stages=1, tensor=1)
    self._checkpoint_dir = checkpoint_dir
    self._weights: dict[bool, Any] = {}
    self._engines: dict[EngineConfig, Engine] = {}
    # The config's engine settings, resolved once (the defaults without a config).
    self.engine_settings = (EngineConfig.from_config(config.engine) if config is not None
                            else EngineConfig())
    # The resolved flag, carried unchanged to the loader, every stage and the server.
    settings = self.engine_settings
    self.load_options, self.generation_settings = runtime_options.consumers_from_resolution(
        resolution, dtype=dtype, max_len=settings.max_len, slots=settings.slots,
        prefill_buckets=settings.prefill_buckets, timing=settings.timing)
    self.weights(with_mtp=self.load_options.native_mtp)

  @functools.cached_property
  def hops(self):
    return LocalHops([self.mesh])

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

  @property
  def last(self) -> int:
    return len(self.stage_layouts(with_mtp=False)) - 1

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

  def stage_layouts(self, *, with_mtp: bool) -> list[StageLayout]:
    """What each stage holds; the NextN block rides on the last stage when MTP is on."""
    return [StageLayout.whole(self.config, mtp=with_mtp)]

  def weights(self, *, with_mtp: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the whole model, with or without the MTP head."""
    return self._cached_weights(with_mtp, lambda: self._load_layout(
        self.stage_layouts(with_mtp=with_mtp)[0], sharding.param_sharding_fn(self.mesh)))

  def stage_weights(self, *, with_mtp: bool) -> list:
    """Per-stage (graphdef, state), None for stages another process owns."""
    return [self.weights(with_mtp=with_mtp)]

  def _cached_weights(self, with_mtp: bool, load):
    with_mtp = with_mtp and self.has_mtp
    if with_mtp not in self._weights:
      if self._weights and with_mtp:
        self._weights.clear()       # the MTP-on weights include everything the others hold
      self._weights[with_mtp] = load()
    return self._weights[with_mtp]

  def _load_layout(self, layout: StageLayout, sharding_fn) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of one layout, from the checkpoint parts or streamed from the source."""
    if self._checkpoint_dir is not None:
      graphdef, abstract, _ = loading.abstract_stage(self.config, layout, self.dtype,
                                                     self._tensor_types, self.weight_mode)
      leaves = checkpoint.restore_leaves(self._checkpoint_dir, layout,
                                         loading.flat_paths(abstract), sharding_fn)
      loaded = loading.assemble(graphdef, abstract, leaves)
    else:
      loaded = loading.load_state(self.source, self.config, layout, dtype=self.dtype,
                                  weights=self.weight_mode, sharding_fn=sharding_fn)
    loaded = quantized.with_kernels(*loaded, self.kernels)
    return quantized.with_int8_activations(*loaded) if self.int8_activations else loaded

  def weight_bytes_by_type(self) -> dict[str, tuple[int, int | None]]:
    """{ggml type name: (device bytes, GGUF bytes)} of the quantized parameters loaded, plus
    {dense dtype name: (device bytes, None)} of the dense ones (see `loading.bytes_by_type`)."""
    return loading.bytes_by_type([entry for entry in self.stage_weights(
        with_mtp=next(iter(self._weights))) if entry is not None])

  # --- full-sequence forwards ---------------------------------------------------------------

  @functools.cached_property
  def _jit_stage(self):
    def run(graphdef, hands_selection, cache_dtype, state, inp):
      """inp: tokens on stage 0, else the hop's (x, selection); the cache is the sequence."""
      model = nnx.merge(graphdef, state)
      length = (inp if model.layout.embeddings else inp[0]).shape[1]
      x, _, selection = fresh_forward(model, inp, length, cache_dtype)
      if not model.layout.output:
        return x, selection if hands_selection else None
      return x, model.lm_logits(x)
    return jax.jit(run, static_argnums=(0, 1, 2))

  @functools.cached_property
  def _jit_mtp(self):
    def run(graphdef, cache_dtype, state, tokens, prev_hidden):
      model = nnx.merge(graphdef, state)
      return model.mtp_logits(fresh_mtp_rows(model, tokens, prev_hidden, cache_dtype)[0])
    return jax.jit(run, static_argnums=(0, 1))

  def _padded(self, token_ids) -> tuple[np.ndarray, int]:
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    padded = np.zeros((1, pow2_bucket(ids.size)), np.int32)
    padded[0, :ids.size] = ids
    return padded, ids.size

  def _run_stages(self, tokens: np.ndarray, weights: list, cache_dtype):
    """(post-norm hidden, logits) on the last stage (None on other processes), over caches of
    `cache_dtype` values."""
    dtype = loading.resolve_dtype(self.dtype)
    b, t = tokens.shape
    like = jax.ShapeDtypeStruct((b, t, self.config.hidden), dtype)
    selections = [selection_like(layout, self.config, b, t, t)
                  for layout in self.stage_layouts(with_mtp=False)] + [None]
    x = tokens
    for s, entry in enumerate(weights):
      if s > 0:
        x = self.hops.move(x, s - 1, s, like=(like, selections[s]))
      if entry is not None:
        x = self._jit_stage(entry[0], selections[s + 1] is not None, cache_dtype, entry[1], x)
    return x if weights[self.last] is not None else None

  @functools.cached_property
  def _tensor_types(self) -> dict[str, str]:
    """GGUF tensor name -> ggml type name: a checkpoint's record of its source, else read from
    the source's tensor infos."""
    if self._checkpoint_dir is not None:
      return self.source.tensor_types
    return loading.tensor_types(self.source)

  @functools.cached_property
  def llama_cpp_arithmetic(self) -> bool:
    """Whether this model multiplies its quantized weights as llama.cpp's CPU backend does:
    int8 rows (`int8_activations`) against weights whose integers take them (XLA:CPU's native
    kernel). Its "auto" KV cache is then llama.cpp's too (`kv_cache_name`)."""
    if not (self.int8_activations and self.weight_mode == "quantized"):
      return False
    return quantized.multiplies_int8_rows(self._tensor_types.values(), self.kernels)

  def kv_cache_name(self, kv_cache_dtype: str) -> str:
    """`kv_cache_dtype` with "auto" resolved: float16 under llama.cpp's arithmetic (its
    default cache, which the int8 rows' results were made with: over a float32 cache they flip
    near-ties the llama.cpp fixtures hold), else the activations' dtype."""
    if kv_cache_dtype == "auto" and self.llama_cpp_arithmetic:
      return "float16"
    return kv_cache_dtype

  def _kv_dtype(self, kv_cache_dtype: str) -> jnp.dtype:
    return kv_dtype(self.kv_cache_name(kv_cache_dtype), loading.resolve_dtype(self.dtype))

  def _trunk(self, token_ids, kv_cache_dtype: str):
    tokens, n = self._padded(token_ids)
    t = tokens.shape[1]
    like = (jax.ShapeDtypeStruct((1, t, self.config.hidden), loading.resolve_dtype(self.dtype)),
            jax.ShapeDtypeStruct((1, t, self.config.vocab_size), jnp.float32))
    weights = self.stage_weights(with_mtp=next(iter(self._weights)))
    out = self._run_stages(tokens, weights, self._kv_dtype(kv_cache_dtype))
    hidden, logits = self.hops.share(out, self.last, like=like)
    return tokens, n, hidden, logits

  def logits(self, token_ids, kv_cache_dtype: str = "auto") -> np.ndarray:
    """[T, vocab] logits of a causal forward over positions 0..T-1, its keys and values kept
    as an engine with `kv_cache_dtype` keeps them ("auto" as `kv_cache_name` resolves it)."""
    _, n, _, logits = self._trunk(token_ids, kv_cache_dtype)
    return np.asarray(logits[0, :n], np.float32)

  def hidden(self, token_ids, kv_cache_dtype: str = "auto") -> np.ndarray:
    """[T, hidden] trunk output after the final norm (what the head and the MTP head see)."""
    _, n, hidden, _ = self._trunk(token_ids, kv_cache_dtype)
    return np.asarray(hidden[0, :n], np.float32)

  def mtp_logits(self, token_ids, kv_cache_dtype: str = "auto") -> np.ndarray:
    """[T, vocab]: row k = token ids[k] at position k with hidden row k-1 (zero for row 0)."""
    if not self.has_mtp:
      raise errors.SpeculativeConfigError(
          "this model has no NextN (MTP) block", path=str(self.source.path),
          field="blk.N.nextn.*", remedy="use a GGUF or package that includes the MTP head")
    weights = self.stage_weights(with_mtp=True)
    tokens, n = self._padded(token_ids)
    cache_dtype = self._kv_dtype(kv_cache_dtype)
    out = self._run_stages(tokens, weights, cache_dtype)
    if out is not None:
      graphdef, state = weights[self.last]
      out = self._jit_mtp(graphdef, cache_dtype, state,
                          jax.device_put(tokens, self.hops.shardings[self.last]),
                          previous_hidden(out[0]))
    like = jax.ShapeDtypeStruct(tokens.shape + (self.config.vocab_size,), jnp.float32)
    return np.asarray(self.hops.share(out, self.last, like=like)[0, :n], np.float32)

  # --- decoding -----------------------------------------------------------------------------

  def resolve(self, requested: str | None):
    """The strategy for one call: None keeps the load-time resolution."""
    if requested is None:
      return self.resolution
    return speculative.resolve_for_source(
        self._run_config or {}, _model_name(self._run_config), self.source,
        override=(requested, "generate(speculative=...)"))

  def engine(self, *, native_mtp: bool, draft_tokens: int = 1, host_drafts: bool = False,
             settings: EngineConfig | None = None, **overrides) -> Engine:
    """A compiled engine, cached by its settings so repeated calls reuse the compiled steps.

    `settings`: the engine settings (default `EngineConfig()`, the defaults the server config
    reads too), with `overrides` of its fields (`slots`, `max_len`, `prefill_buckets`,
    `timing`, `logprobs`, `prefix_cache`, `kv_page`, `kv_pages`, `kv_cache_dtype`,
    `decode_steps`); without `settings` or `prefill_buckets`, the default buckets that fit
    `max_len`.
    `draft_tokens`: the deepest draft window its steps verify (native MTP, or `host_drafts`:
    an n-gram proposer's, alone or extending the MTP chain). A `kv_cache_dtype` of "auto" is
    resolved as `kv_cache_name` says."""
    engine_cfg = dataclasses.replace(settings or EngineConfig(), **overrides)
    if settings is None and "prefill_buckets" not in overrides:
      engine_cfg = dataclasses.replace(engine_cfg, prefill_buckets=engine_cfg.fitting_buckets())
    drafts = native_mtp or host_drafts
    engine_cfg = dataclasses.replace(
        engine_cfg, native_mtp=native_mtp, draft_tokens=draft_tokens if drafts else 1,
        host_drafts=host_drafts, prefill_buckets=tuple(engine_cfg.prefill_buckets),
        kv_cache_dtype=self.kv_cache_name(engine_cfg.kv_cache_dtype))
    if engine_cfg not in self._engines:
      self._engines[engine_cfg] = Engine(
          self.stage_weights(with_mtp=native_mtp), self.stage_layouts(with_mtp=native_mtp),
          self.hops, self.config, engine_cfg, dtype=loading.resolve_dtype(self.dtype))
    return self._engines[engine_cfg]

  def drafting_engine(self, resolution, window: DraftWindow | None = None, **settings
                      ) -> tuple[Engine, HostDrafting]:
    """The engine a resolved strategy decodes with, and what its scheduler needs of it
    (`HostDrafting`: the per-request drafter); `window`: native MTP's (default: the
    resolution's); `settings` as `engine` takes them."""
    drafting = HostDrafting.of(resolution, resolution.draft_window if window is None else window)
    return self.engine(native_mtp=resolution.native_mtp, draft_tokens=drafting.draft_tokens,
                       host_drafts=drafting.host, **settings), drafting

  def generate(self, prompt_ids, *, max_new_tokens: int,
               temperature: float = SamplerParams.temperature, top_k: int = SamplerParams.top_k,
               top_p: float = SamplerParams.top_p, seed: int = SamplerParams.seed, stop_ids=(),
               speculative: str | None = None, timing: bool = False,
               adaptive_drafting: bool = True, logprobs: bool = False,
               draft_window: DraftWindow | None = None, kv_cache_dtype: str = "auto",
               decode_steps: int = EngineConfig.decode_steps) -> Result:
    """Decode one prompt; `Result.tokens` and `Result.stats` (MTP counters).

    `logprobs`: `Result.logprobs` holds each token's logprob and top MAX_TOP_LOGPROBS.
    `kv_cache_dtype`: the KV cache's values, as `engine.kv_cache_dtype` (`kv_cache_name`).
    `decode_steps`: decode positions a dispatch computes without drafts (`engine.decode_steps`;
    the tokens are the same).

    With `adaptive_drafting`, MTP pauses while its drafts keep being rejected (see
    `AdaptiveDrafting`); the tokens are the same either way. `draft_window`: drafts per step
    (default: the resolved strategy's window).
    """
    resolution = self.resolve(speculative)
    window = resolution.draft_window if draft_window is None else draft_window
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    max_len = max(128, pow2_bucket(prompt.size + max_new_tokens + 1))
    # One request: one slot, and no prefix cache (its state lives only for this call).
    engine, drafting = self.drafting_engine(resolution, window, slots=1, max_len=max_len,
                                            timing=timing, prefix_cache=0,
                                            logprobs=MAX_TOP_LOGPROBS if logprobs else 0,
                                            kv_cache_dtype=kv_cache_dtype,
                                            decode_steps=decode_steps)
    request = Request(prompt=prompt, max_new_tokens=int(max_new_tokens),
                      sampler=SamplerParams(temperature, top_k, top_p, seed),
                      stop_ids=frozenset(int(t) for t in stop_ids), logprobs=logprobs)
    policy = AdaptiveDrafting() if adaptive_drafting else None
    return SlotScheduler(engine, adaptive=policy, window=window,
                         drafter=drafting.drafter).run([request])[0]


class PipelinedModel(Model):
  """A `Model` over pipeline stages: one (graphdef, state) per stage, None for stages other
  processes own."""

  def __init__(self, source, cfg, *, dtype: str, resolution, plan: PipelinePlan, config=None,
               checkpoint_dir=None, weights: str = "quantized", int8_activations: bool = True,
               kernels: backend.Kernels | None = None):
    self.plan = plan
    super().__init__(source, cfg, dtype=dtype, resolution=resolution, config=config,
                     mesh=plan.meshes[0], checkpoint_dir=checkpoint_dir, weights=weights,
                     int8_activations=int8_activations, kernels=kernels)

  @functools.cached_property
  def hops(self):
    return make_hops(self.plan.meshes)

  def stage_layouts(self, *, with_mtp: bool) -> list[StageLayout]:
    return self.plan.layouts(self.config, with_mtp=with_mtp)

  def weights(self, *, with_mtp: bool) -> list:
    """Per-stage (graphdef, state), each on its stage's sub-mesh; None where not local."""
    return self._cached_weights(with_mtp, lambda: [
        self._load_layout(layout, sharding.param_sharding_fn(self.plan.meshes[s]))
        if self.hops.local(s) else None
        for s, layout in enumerate(self.stage_layouts(with_mtp=with_mtp and self.has_mtp))])

  def stage_weights(self, *, with_mtp: bool) -> list:
    return self.weights(with_mtp=with_mtp)


def _open(source_path, weights: str | None):
  """(source, cfg, checkpoint dir or None, weights) for a package, GGUF or converted checkpoint.

  `weights` None: a checkpoint's own form, else "quantized"; a checkpoint restores only the
  form it was converted to.
  """
  path = pathlib.Path(source_path)
  if checkpoint.is_checkpoint(path):
    record = checkpoint.read_record(path)
    src = record["source"]
    if weights is not None and weights != record["weights"]:
      raise errors.CheckpointError(
          f"the checkpoint holds {record['weights']} weights, not {weights}",
          path=str(path), field="weights",
          remedy=f"load it with weights={record['weights']!r}, or convert the source again "
                 f"with python -m mtpjax.convert --weights={weights}")
    manifest = (parse_manifest(src["manifest"], path=src["path"])
                if src["manifest"] is not None else None)
    source = CheckpointSource(
        kind=src["kind"], path=path, manifest=manifest, manifest_sha256=src["manifest_sha256"],
        metadata=record["metadata"], tensors={n: None for n in src["tensor_names"]},
        layer_count=src["layer_count"], tensor_types=src["tensor_types"],
        weights=record["weights"])
    return source, ModelConfig.from_dict(record["model_config"]), path, record["weights"]
  source = open_source(path)
  return (source, registry.config_from_gguf(source.metadata, source.tensors, source=str(path)),
          None, weights or "quantized")


def _weights_setting(weights: str | None, config) -> str | None:
  """The explicit argument wins over `config.model.weights`; validated before any I/O."""
  if weights is None and config is not None:
    weights = config.model.get("weights")
  return None if weights is None else loading.resolve_weights(weights)


def _kernels_setting(kernels: str | None, config) -> tuple[backend.Kernels, str]:
  """(the kernels, the choice as given): the explicit argument wins over
  `config.engine.kernels`; "auto" without either. Resolving builds the native CPU kernel now
  (never inside a trace); a choice that cannot run here is a typed error before any I/O."""
  field = "kernels"
  if kernels is None and config is not None:
    kernels, field = config.engine.get("kernels"), "engine.kernels"
  choice = kernels or backend.DEFAULT
  return backend.resolve(choice, field=field), choice


def _int8_setting(int8_activations: bool | None, config, weights: str,
                  kernels: tuple[backend.Kernels, str]) -> bool:
  """The explicit argument wins over `config.model.int8_activations`. On XLA:CPU with quantized
  weights it decides: neither set, int8 rows where the `native` kernels multiply them (a
  warning where they cannot, unless `xla` or `pallas` was chosen); True where they cannot is a typed
  error, since float32 rows would give other tokens. Elsewhere the setting has no effect
  (accelerators contract in float32)."""
  kernels, choice = kernels
  if int8_activations is None and config is not None:
    int8_activations = config.model.get("int8_activations")
  if kernels.platform != "cpu" or weights != "quantized":
    return True if int8_activations is None else bool(int8_activations)
  here = quantized.int8_rows_here(kernels)
  if int8_activations is None:
    if not here and choice in (backend.DEFAULT, "native"):   # not a choice of float32 rows
      logging.warning("int8 rows cannot run here (%s): quantized weights multiply float32 rows, "
                      "whose tokens can differ from a machine with the kernel's int8 rows",
                      quantized.int8_rows_missing(kernels))
    return here
  if int8_activations and not here:
    raise errors.MtpjaxError(
        f"int8_activations=True needs the native CPU kernel's int8 rows, which cannot run "
        f"here: {quantized.int8_rows_missing(kernels)}", field="model.int8_activations",
        remedy="install a C++ compiler (g++, or set CXX) on a CPU with AVX2, or set "
               "int8_activations=False (--config.model.int8_activations=false) for float32 rows")
  return bool(int8_activations)


def _mesh_settings(config, stages: int, splits) -> tuple[int, Sequence[int] | None, int]:
  """(stages, splits, tensor): explicit arguments win over `config.mesh.*`."""
  if config is None:
    return stages, splits, 1
  mesh = config.mesh
  if stages == 1 and splits is None:
    stages, splits = int(mesh.stages), mesh.splits
  return stages, splits, int(mesh.tensor)


def load_pipelined(source, *, dtype: str, stages: int, splits=None, config=None,
                   weights: str | None = None, int8_activations: bool | None = None,
                   kernels: str | None = None) -> Model:
  """Check the mesh and the stage plan (typed errors before any weight is read), then load
  only the stages this process owns."""
  weights = _weights_setting(weights, config)
  kernel_setting = _kernels_setting(kernels, config)
  stages, splits, tensor = _mesh_settings(config, stages, splits)
  if splits is not None and not isinstance(splits, (list, tuple)):
    raise errors.MeshConfigError(f"splits must be a sequence of layer boundaries, got {splits!r}",
                                 field="mesh.splits", remedy="pass e.g. splits=(15, 31)")
  pipeline_mesh(stages, tensor)
  src, cfg, checkpoint_dir, weights = _open(source, weights)
  plan = plan_pipeline(src.layer_count, stages, splits, tensor=tensor)
  resolution = speculative.resolve_for_source(config or {}, _model_name(config), src)
  return PipelinedModel(src, cfg, dtype=dtype, resolution=resolution, plan=plan, config=config,
                        checkpoint_dir=checkpoint_dir, weights=weights,
                        int8_activations=_int8_setting(int8_activations, config, weights,
                                                       kernel_setting),
                        kernels=kernel_setting[0])


def _model_name(config) -> str:
  return config.model.name if config is not None else DEFAULT_MODEL_NAME


def load(source, *, dtype: str = "float32", weights: str | None = None, stages: int = 1,
         splits=None, config=None, mesh=None, int8_activations: bool | None = None,
         kernels: str | None = None) -> Model:
  """Open `source`, resolve the speculative strategy and load the weights.

  `dtype` is the activation dtype (and that of dense weights). `weights`: "quantized" (the
  default; GGUF-quantized tensors stay integers + scales on the device, computing with values
  equal to gguf-py's dequantization) or "dense" (dequantized to `dtype` at load); None takes
  `config.model.weights`, or a checkpoint's own form. `int8_activations` (None takes
  `config.model.int8_activations`, else where the native kernel runs them): on XLA:CPU,
  quantized weights multiply rows rounded to int8 per block as integers, as llama.cpp does
  (about 2x faster decode there; the weights stay exact, the results move by the rounding of
  the rows, and an "auto" KV cache is llama.cpp's float16: `Model.kv_cache_name`); False keeps
  float32 rows; True where the kernel cannot run them is a typed error. `kernels` (None takes
  `config.engine.kernels`, else "auto"): "auto" | "xla" | "native" | "pallas", the
  implementations of the hot operations (`mtpjax/kernels/backend.py`); "auto" is "native" on
  a CPU where the native kernels build, else "xla".
  """
  loading.resolve_dtype(dtype)
  weights = _weights_setting(weights, config)
  mesh_cfg = config.mesh if config is not None else None
  if (stages != 1 or splits is not None
      or (mesh_cfg is not None and (mesh_cfg.stages != 1 or mesh_cfg.splits is not None))):
    return load_pipelined(source, dtype=dtype, stages=stages, splits=splits, config=config,
                          weights=weights, int8_activations=int8_activations, kernels=kernels)
  if mesh is None and mesh_cfg is not None and mesh_cfg.tensor != 1:
    mesh = sharding.make_mesh(stages=1, tensor=mesh_cfg.tensor)   # fails before any I/O
  kernel_setting = _kernels_setting(kernels, config)
  src, cfg, checkpoint_dir, weights = _open(source, weights)
  resolution = speculative.resolve_for_source(config or {}, _model_name(config), src)
  return Model(src, cfg, dtype=dtype, resolution=resolution, config=config, mesh=mesh,
               checkpoint_dir=checkpoint_dir, weights=weights,
               int8_activations=_int8_setting(int8_activations, config, weights, kernel_setting),
               kernels=kernel_setting[0])
